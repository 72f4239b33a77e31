"""What of the ``slurm`` section may reach a batch script, and how it is written there.

The launcher is the only code that writes a batch script (``profiles.slurm_parameters``; submitit renders it),
so the rules that keep each value on its line and meaning what it says live here, beside it, rather than in
the config, which checks only the job's shape (``roformer_dist.config.validate``):

- ``slurm.partition``, ``account`` and ``qos`` hold only letters, digits and ``_ - . ,``;
  ``slurm.constraint`` also the feature operators ``& | ! * : [ ] ( )`` (no spaces);
- ``slurm.env`` and ``slurm.env_from`` keys, and ``env_from`` values, are variable names
  (``[A-Za-z_][A-Za-z0-9_]*``);
- no SLURM string, ``slurm.setup`` line, ``slurm.env`` value or ``run_dir`` holds a control character
  (a newline would start a script line of its own);
- a ``slurm.env`` value expands only ``$NAME`` and ``${NAME}``: command substitution (``$(...)``, backticks)
  and other ``${...}`` forms are refused; ``double_quoted`` writes it so that every other character is
  literal.

``validate_slurm`` checks all of them, raising :class:`~roformer_dist.errors.ConfigError` naming the key.
"""

from __future__ import annotations

import re

from roformer_dist.config import SlurmConfig
from roformer_dist.errors import ConfigError

SLURM_NAME_CHARS = "letters, digits and _ - . , (a comma separates several)"
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.,-]*")
_NODE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
SLURM_CONSTRAINT_CHARS = "feature names (letters, digits, _ - .) and the operators & | , ! * : [ ] ( )"
_SLURM_CONSTRAINT = re.compile(r"[A-Za-z0-9_.,&|!*:\[\]()-]*")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
"""C0 control characters and DEL: a newline or CR would start a line of its own in a shell script."""
_ENV_SUBST = re.compile(r"\$\(|`")
_ENV_BRACED = re.compile(r"\$\{([^}]*)\}?")
ENV_REFERENCE = re.compile(rf"\$(?:{ENV_NAME.pattern}|\{{{ENV_NAME.pattern}\}})")
"""``$NAME`` or ``${NAME}``: the one form of expansion an ``slurm.env`` value may use."""


def check_line(value: str, key: str) -> None:
    """ConfigError naming ``key`` when ``value`` holds a control character (newline, CR, NUL, tab, ...)."""
    m = CONTROL_CHARS.search(value)
    if m:
        raise ConfigError(f"{key}: control character {m.group()!r} in {value!r}: expected one line of printable "
                          "text (it is written into the SLURM batch script)")


def _check_env_value(value: str, key: str) -> None:
    check_line(value, key)
    if _ENV_SUBST.search(value):
        raise ConfigError(f"{key}: command substitution ($(...) or backticks) in {value!r}: the batch shell expands "
                          "only $NAME and ${NAME} in slurm.env; run commands in slurm.setup, or take a value from "
                          "the submitting environment with slurm.env_from")
    for m in _ENV_BRACED.finditer(value):
        if not (m.group().endswith("}") and ENV_NAME.fullmatch(m.group(1))):
            raise ConfigError(f"{key}: {m.group()!r} in {value!r}: only $NAME and ${{NAME}} are expanded")


def validate_slurm(s: SlurmConfig) -> None:
    """The rules of the module docstring for the ``slurm`` section (``run_dir``: ``check_line``)."""
    for key in ("partition", "account", "qos", "constraint"):
        pattern, what = ((_SLURM_CONSTRAINT, SLURM_CONSTRAINT_CHARS) if key == "constraint" else
                         (_SLURM_NAME, SLURM_NAME_CHARS))
        value = getattr(s, key)
        check_line(value, f"slurm.{key}")
        if not pattern.fullmatch(value):
            raise ConfigError(f"slurm.{key}: expected {what}, got {value!r}")
    for i, node in enumerate(s.exclude):
        if not _NODE_NAME.fullmatch(node):
            raise ConfigError(f"slurm.exclude[{i}]: expected a node name (letters, digits and _ - .), got {node!r}")
    if s.max_hang_requeues < 0:
        raise ConfigError(f"slurm.max_hang_requeues: expected 0 or more, got {s.max_hang_requeues}")
    for i, line in enumerate(s.setup):
        check_line(line, f"slurm.setup[{i}]")
    for section in ("env", "env_from"):
        for name, value in getattr(s, section).items():
            if not ENV_NAME.fullmatch(name):
                raise ConfigError(f"slurm.{section}: {name!r} is not an environment variable name (expected "
                                  "letters, digits and _, not starting with a digit)")
            if section == "env":
                _check_env_value(value, f"slurm.env.{name}")
            elif not ENV_NAME.fullmatch(value):
                raise ConfigError(f"slurm.env_from.{name}: expected the name of a variable of the submitting "
                                  f"environment (letters, digits and _, not starting with a digit), got {value!r}")


def double_quoted(value: str, key: str = "slurm.env") -> str:
    """``value`` in double quotes for the batch shell: ``$NAME`` / ``${NAME}`` expand, all else is literal.

    ``\\``, ``"``, backticks and every ``$`` that starts no such reference are escaped, so nothing but
    those two forms of parameter expansion happens (no command substitution, arithmetic or ``${x:-...}``).
    A control character is refused (it would end the line)."""
    check_line(value, key)
    out, i = [], 0
    while i < len(value):
        m = ENV_REFERENCE.match(value, i)
        if m:
            out.append(m.group())
            i = m.end()
            continue
        c = value[i]
        out.append("\\" + c if c in '\\"`$' else c)
        i += 1
    return '"' + "".join(out) + '"'


def env_from_line(key: str, name: str) -> str:
    """The batch-script line of ``slurm.env_from.<key>: <name>``: names only, never the value."""
    missing = f"is not set: slurm.env_from.{key} reads it from the environment of roformer-submit"
    if key == name:  # sbatch exports it as it is: only check that it arrived
        return f': "${{{name}?{missing}}}"'
    return f'export {key}="${{{name}?{missing}}}"'
