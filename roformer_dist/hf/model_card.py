"""The README.md model card of an HF export: architecture, training data, curriculum, steps, tokens seen,
final eval metrics, tokenizer notes and how to load and fine-tune the model."""

from __future__ import annotations

from typing import Any

from roformer_dist.config import training_sources


def _fmt_int(n: Any) -> str:
    return f"{int(n):,}" if isinstance(n, (int, float)) else "unknown"


def _architecture(cfg, num_parameters: int) -> list[str]:
    emb = cfg.embedding_size or cfg.hidden_size
    rows = [("layers", cfg.num_hidden_layers), ("hidden size", cfg.hidden_size),
            ("attention heads", cfg.num_attention_heads), ("feed-forward size", cfg.intermediate_size),
            ("activation", cfg.hidden_act), ("embedding size", emb), ("vocabulary", cfg.vocab_size),
            ("max positions", cfg.max_position_embeddings), ("token types", cfg.type_vocab_size),
            ("position encoding", _positions(cfg)),
            ("attention", getattr(cfg, "attention", "softmax")), ("parameters", _fmt_int(num_parameters))]
    return ["| | |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows]


def _positions(cfg) -> str:
    """The position encoding in words: rotary with its base and scaling, or absolute."""
    if cfg.position_embedding != "rotary":
        return "absolute (learned)"
    text = f"rotary (RoPE), base {cfg.rope_theta:g}" + (", on values too" if cfg.rotary_value else "")
    if cfg.rope_scaling != "none":
        text += f", {cfg.rope_scaling} scaling x{cfg.rope_scaling_factor:g}"
        if cfg.rope_original_max_position:
            text += f" of {cfg.rope_original_max_position} positions"
    return text


def _parent(parent) -> list[str]:
    """Where the weights started (a warm start or fork: the run's parent.json)."""
    if not parent:
        return []
    at = f" at step {parent['step']}" if parent.get("step") is not None else ""
    if parent.get("decay_steps"):
        return [f"- a decay branch: resumed {parent.get('kind')} `{parent.get('path')}`{at} (config sha256 "
                f"`{str(parent.get('config_sha256', ''))[:16]}...`) whole and decayed the learning rate over "
                f"{parent['decay_steps']} steps ({parent.get('decay_shape') or 'wsd'})"]
    return [f"- initialised from: {parent.get('kind')} `{parent.get('path')}`{at} (config sha256 "
            f"`{str(parent.get('config_sha256', ''))[:16]}...`); this run continued from those weights"]


def _manifest_lines(name: str, path, m: dict) -> list[str]:
    out = [f"- {name}: `{path}` — {_fmt_int(m.get('num_docs'))} documents, {_fmt_int(m.get('num_tokens'))} "
           f"tokens in {len(m.get('shards', []))} shards"]
    if m.get("text_bytes"):
        out[-1] += f", {m['text_bytes'] / 1e6:.1f} MB of normalised text"
    return out


def _schedule(optim) -> str:
    """The LR schedule after the warmup, in words."""
    if optim.schedule == "wsd":
        decay = f"{optim.decay_steps} steps" if optim.decay_steps else f"the last {optim.decay_fraction:.0%} of steps"
        return f"warmup-stable-decay ({optim.decay_shape} decay over {decay}, to {optim.min_lr_ratio:g} x lr)"
    return f"{optim.schedule} decay"


def _training(source) -> list[str]:
    cfg = source.run_config
    lines = ["## Training", ""]
    if cfg is None:
        return lines + [f"Converted from {source.description}; no training record came with it.", ""]
    t = source.trainer
    rates = [st.mlm_probability if st.mlm_probability is not None else cfg.data.mlm_probability
             for st in cfg.curriculum.stages]
    masking = f"{rates[0]:.0%} of tokens" if len(set(rates)) == 1 else \
        f"{' -> '.join(f'{r:.0%}' for r in rates)} of tokens by stage"
    lines += [f"Pretrained with roformer-dist (masked language modelling, {masking}"
              f"{', whole-word masking' if cfg.data.whole_word_mask else ''}; evaluated at "
              f"{cfg.data.eval_mlm_probability:.0%}); exported from {source.description}.", "",
              f"- steps: {_fmt_int(t.get('step'))}; tokens seen: {_fmt_int(t.get('tokens_seen'))}; "
              f"sequences seen: {_fmt_int(t.get('samples_seen'))}",
              f"- optimiser: {cfg.optim.name}, peak lr {cfg.optim.lr:g}, {cfg.optim.warmup_steps} warm-up steps, "
              f"{_schedule(cfg.optim)}, weight decay {cfg.optim.weight_decay:g}; DeepSpeed ZeRO-"
              f"{cfg.deepspeed.zero_stage}, {cfg.deepspeed.precision}; seed {cfg.trainer.seed}",
              *_parent(source.parent)]
    sources = training_sources(cfg.data)
    if len(sources) > 1:
        listed = ", ".join(f"`{s.name}` (`{s.shards}`, weight {s.weight if s.weight is not None else 1:g}"
                           f"{f', at most {s.max_epochs:g} epochs' if s.max_epochs is not None else ''})"
                           for s in sources)
        lines.append(f"- training data: a mixture of {len(sources)} sources weighted by their share of tokens: "
                     f"{listed}{f'; sizes smoothed by alpha {cfg.data.size_alpha:g}' if cfg.data.size_alpha is not None else ''}")
    elif source.manifest is not None:
        lines += _manifest_lines("training data", source.shard_dir, source.manifest)
    else:
        lines.append(f"- training data: `{sources[0].shards if sources else ''}` (shard set not found at export time)")
    if source.eval_manifest is not None:
        lines += _manifest_lines("evaluation data", cfg.data.eval_shards, source.eval_manifest)
    lines += ["", "Sequence-length curriculum (stages run in order):", "",
              "| stage | sequence length | global batch | steps | lr | masking |",
              "| --- | --- | --- | --- | --- | --- |"]
    for st, rate in zip(cfg.curriculum.stages, rates):
        lr = f"{st.lr:g} (re-warm-up {st.warmup_steps})" if st.lr is not None else "schedule"
        lines.append(f"| {st.name} | {st.seq_len} | {st.global_batch_size} | {st.steps} | {lr} | {rate:.0%} |")
    lines.append("")
    return lines


def _evaluation(source) -> list[str]:
    lines = ["## Evaluation", ""]
    ev = source.eval_metrics
    lengths = sorted({int(k.rsplit("_", 1)[1]) for k in ev if k.startswith("eval/loss_")})
    if not lengths:
        return lines + ["No evaluation was recorded for this checkpoint.", ""]
    lines += [f"Masked-LM on the held-out shards at step {source.eval_step}:", "",
              "| length | loss | accuracy |", "| --- | --- | --- |"]
    for n in lengths:
        acc = ev.get(f"eval/mlm_acc_{n}")
        lines.append(f"| {n} | {ev[f'eval/loss_{n}']:.4f} | {'' if acc is None else f'{acc:.4f}'} |")
    return lines + [""]


def _tokenizer(result, info: dict) -> list[str]:
    lines = ["## Tokenizer", ""]
    if result.tokenizer is None:
        return lines + ["This export has no tokenizer (written with `--no-tokenizer`): `AutoTokenizer` cannot "
                        "load it. Re-export with `roformer-convert to-hf --tokenizer <shard set or .model>`.", ""]
    tok = info["tokenizer"]
    if tok.get("kind", "sentencepiece") != "sentencepiece":
        ids = " ".join(f"`[{k.upper()}]`={v}" for k, v in tok["special_ids"].items())
        what = "a WordPiece `vocab.txt` (BERT's rules: CJK characters split, lower-cased, accents stripped)" \
            if tok["kind"] == "wordpiece-vocab" else "an imported `tokenizer.json`"
        lines += [f"Imported: {what}, {tok['vocab_size']:,} entries (sha256 `{tok['sha256'][:16]}...`), with the "
                  "pretraining pipeline's text normalisation (NFKC, control characters removed, whitespace "
                  f"collapsed) before its own. Inputs are `[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]`. Special ids: "
                  f"{ids} (the imported vocabulary's own).", ""]
        return lines + _roundtrip(tok)
    lines += [f"SentencePiece Unigram, {tok['vocab_size']:,} pieces (`tokenizer.model`, sha256 "
              f"`{tok['sha256'][:16]}...`), with the pretraining pipeline's text normalisation in "
              "`tokenizer.json`: NFKC (full-width -> half-width), control and format characters removed, "
              "whitespace runs collapsed to one space and stripped; spaces are `▁`; characters outside the "
              "vocabulary fall back to UTF-8 bytes. Inputs are `[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]` with "
              "token type ids 0 for A and 1 for B. Special ids: `[PAD]`=0 `[UNK]`=1 `[CLS]`=2 `[SEP]`=3 "
              "`[MASK]`=4.", "",
              "The literal strings `[MASK]`, `[CLS]`, ... in an input become the special ids (as with every HF "
              "tokenizer; fill-mask needs it). Pretraining never produced them from text: load with "
              "`AutoTokenizer.from_pretrained(path, split_special_tokens=True)` to tokenise them as text.", ""]
    lines += _roundtrip(tok, sentencepiece=True)
    if result.jieba:
        lines += ["**jieba word pre-segmentation.** This tokenizer was trained (and the model pretrained) on "
                  "jieba words: SentencePiece encoded each jieba word on its own. `tokenizer.json` cannot run "
                  "jieba, so `AutoTokenizer` encodes the whole text at once and its ids differ from the "
                  "training ids where a piece would cross a jieba word boundary (the check above measures how "
                  "often). For the exact training ids use:", "",
                  "```python",
                  "import jieba, sentencepiece as spm",
                  "from data_pipeline.corpus import normalize    # roformer-dist",
                  "sp = spm.SentencePieceProcessor(model_file=f\"{path}/tokenizer.model\")",
                  "words = [w for w in jieba.cut(normalize(text)) if w]",
                  "ids = [2] + [i for w in sp.encode(words) for i in w] + [3]    # [CLS] ... [SEP]",
                  "```", ""]
    return lines


def _roundtrip(tok: dict, sentencepiece: bool = False) -> list[str]:
    check = tok.get("roundtrip_check")
    if not check:
        return []
    rate = check["identical"] / max(1, check["documents"])
    line = (f"Check at export: {check['identical']:,} of {check['documents']:,} training documents "
            f"({100 * rate:.2f}%) decoded from the shards and re-encoded with `tokenizer.json` give "
            "exactly the training ids.")
    if sentencepiece:
        line += (" SentencePiece sums piece scores in float32, `tokenizers` in float64: where two segmentations "
                 "score within float32 rounding of each other the two can pick different ones.")
    return [line, ""]


def render_model_card(cfg, result, source, info: dict) -> str:
    """README.md of an export (``result``: export.ExportResult, ``source``: export.ExportSource)."""
    name = result.out.name
    lines = ["---", "language: zh", "library_name: transformers", "pipeline_tag: fill-mask",
             "tags: [roformer, rotary-position-embedding, masked-lm, roformer-dist]", "---", "",
             f"# {name}", "",
             "A RoFormer encoder (BERT-style, rotary position embedding) pretrained with roformer-dist and "
             "exported for Hugging Face `transformers` (`RoFormerForMaskedLM`).", "",
             "## Architecture", "", *_architecture(cfg, result.num_parameters), "",
             *_training(source), *_evaluation(source), *_tokenizer(result, info),
             "## How to load", "",
             "```python",
             "from transformers import AutoTokenizer, AutoModelForMaskedLM, pipeline",
             f"path = \"{result.out}\"",
             "tokenizer = AutoTokenizer.from_pretrained(path)",
             "model = AutoModelForMaskedLM.from_pretrained(path)",
             "fill = pipeline(\"fill-mask\", model=model, tokenizer=tokenizer)",
             "print(fill(\"今天天气很[MASK]。\"))",
             "```", "",
             "`AutoModelForSequenceClassification.from_pretrained(path, num_labels=N)` adds a freshly "
             "initialised classification head. To fine-tune and evaluate on jsonl or tsv files:", "",
             "```bash",
             f"roformer-finetune --model {result.out} --train train.jsonl --dev dev.jsonl --out finetuned/",
             "```", "",
             "## Files", "", ", ".join(f"`{f}`" for f in result.files or []) or "(see the directory)", ""]
    return "\n".join(lines)
