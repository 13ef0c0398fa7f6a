"""The text side of settings files: parse YAML with line numbers, write atomically, edit in place.

Nothing here knows the settings keys; `ktlong.config` decides what the entries mean. Files are
edited as text (append a block, change one value) so a user's comments and layout always survive.
"""
from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ktlong.errors import KtlongError


@dataclass(frozen=True)
class Entry:
    """One top-level `key: value` of a settings file."""

    value: Any
    line: int  # 1-based line of the key


def parse_mapping(text: str, origin: str) -> dict[str, Entry]:
    """Parse a YAML document whose top level is a flat `key: value` mapping.

    `origin` (a path or a label) prefixes every error. An empty document is an empty mapping.
    """
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return {}
        if not isinstance(root, yaml.MappingNode):
            line = root.start_mark.line + 1
            raise KtlongError(f"{origin}:{line}: expected `key: value` lines at the top level",
                              hint="each line should look like `block_size: 128`")
        out: dict[str, Entry] = {}
        for knode, vnode in root.value:
            line = knode.start_mark.line + 1
            key = loader.construct_object(knode, deep=True)
            if not isinstance(key, str):
                raise KtlongError(f"{origin}:{line}: '{key}' is not a setting name",
                                  hint="each line should look like `block_size: 128`")
            if key in out:
                raise KtlongError(f"{origin}:{line}: '{key}' is set twice (first on line "
                                  f"{out[key].line})", hint="delete one of the two lines")
            out[key] = Entry(loader.construct_object(vnode, deep=True), line)
        return out
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{origin}:{mark.line + 1}:{mark.column + 1}" if mark else origin
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise KtlongError(f"{where}: YAML syntax error: {problem}",
                          hint="fix that line; values look like `key: value`") from None
    finally:
        loader.dispose()


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise KtlongError(f"cannot read {path}: {e.strerror or e}",
                          hint="check the file's permissions, or set KTLONG_HOME "
                               "to another folder") from None
    except UnicodeDecodeError:
        raise KtlongError(f"{path} is not UTF-8 text", hint="save it as UTF-8") from None


def atomic_write(path: Path, text: str) -> None:
    """Replace `path` with `text`: temp file in the same folder, fsync, rename, fsync the folder."""
    mode = path.stat().st_mode & 0o777 if path.exists() else None
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def append_block(path: Path, block: str) -> None:
    """Append `block` to the file, keeping every existing byte as it is."""
    text = read_text(path)
    if text and not text.endswith("\n"):
        text += "\n"
    atomic_write(path, text + block)


def set_value(path: Path, key: str, value_text: str, comment: str = "") -> None:
    """Change one top-level `key: value` line in place (its trailing comment kept), or append it.

    The file must parse before and must read back `key` afterwards; otherwise nothing is written.
    """
    set_values(path, {key: value_text}, {key: comment} if comment else None)


def set_values(path: Path, values: dict[str, str], comments: dict[str, str] | None = None,
               drop_comments: Collection[int] = ()) -> None:
    """`set_value` for several keys in one atomic write: all of them change, or none.
    `drop_comments`: 1-based lines to delete in the same write, each a comment line."""
    text = read_text(path)
    before = parse_mapping(text, str(path))
    lines = text.splitlines(keepends=True)
    new_text = "".join(line for i, line in enumerate(lines, 1)
                       if i not in drop_comments or not line.lstrip().startswith("#"))
    for key, value_text in values.items():
        new_text = _edit(new_text, path, key, value_text, (comments or {}).get(key, ""))
    after = parse_mapping(new_text, str(path))
    keys = set(values)
    if not keys <= set(after) or set(after) - keys != set(before) - keys:
        raise KtlongError(f"{path}: editing {', '.join(map(repr, values))} would change other "
                          "settings; left untouched",
                          hint="write " + ", ".join(f"`{k}: {v}`" for k, v in values.items())
                          + " there yourself")
    atomic_write(path, new_text)


def _edit(text: str, path: Path, key: str, value_text: str, comment: str) -> str:
    """`text` with `key`'s value line changed, or `key: value` appended."""
    before = parse_mapping(text, str(path))
    lines = text.splitlines(keepends=True)
    # groups: `key: ` | value | `  # comment` | line end
    pattern = re.compile(rf"^(['\"]?{re.escape(key)}['\"]?[ \t]*:[ \t]*)([^#\r\n]*?)"
                         r"([ \t]*#[^\r\n]*)?(\r?\n)?$")
    if key in before:
        i = before[key].line - 1
        m = pattern.match(lines[i]) if i < len(lines) else None
        if m is None:
            raise KtlongError(f"{path}:{i + 1}: cannot edit the value of '{key}' on this line",
                              hint=f"write `{key}: {value_text}` there yourself")
        lines[i] = m.group(1) + value_text + (m.group(3) or "") + (m.group(4) or "")
        return "".join(lines)
    if text and not text.endswith("\n"):
        text += "\n"
    return text + (f"# {comment}\n" if comment else "") + f"{key}: {value_text}\n"
