import sys

from roformer_dist.finetune.cli import main

sys.exit(main())
