"""Full disk and read-only home: a prompt-cache write that hits ENOSPC leaves the answer given,
the cache as it was (no partial entry, no temporary file, earlier entries intact) and one warning
line; a KTLONG_HOME that cannot be written still chats (defaults, no cache, one warning), and
`memcheck --write` there says one line. ENOSPC is injected into the entry's writes; the home is a
path under a file (root ignores permission bits, not ENOTDIR)."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ktlong import promptcache
from ktlong.cli import app
from ktlong.engine import Sampling
from ktlong.model import load_model
from ktlong.promptcache import open_document
from ktlong.tinymodel import filler_text

from .models import hf_model, settings

NOSPACE = os.strerror(errno.ENOSPC)


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    return load_model(hf_model("llama"), device="CPU", dtype="float32")


def _ids(lm: Any, n: int, seed: int) -> list[int]:
    return lm.tokenizer(filler_text(n, seed=seed))["input_ids"][:n]


class _FullDisk:
    """A file that takes `room` bytes, then fails each write with ENOSPC (as a full disk does)."""

    def __init__(self, f: Any, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        if n > self.room:
            raise OSError(errno.ENOSPC, NOSPACE)
        self.room -= n
        return self.f.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def fill_disk(monkeypatch: pytest.MonkeyPatch, room: int = 100_000) -> None:
    """Entries written from now on find `room` bytes of free disk."""
    def opener(path: Any, mode: str = "r", *a: Any, **kw: Any) -> Any:
        f = open(path, mode, *a, **kw)
        return _FullDisk(f, room) if ".tmp-" in str(path) and "w" in mode else f

    monkeypatch.setattr(promptcache, "open", opener, raising=False)  # shadows the builtin


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_full_disk_costs_the_cache_entry_not_the_answer_or_the_cache(
        lm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    st = settings()
    first = open_document(lm, st, _ids(lm, 700, 1), cache_dir=tmp_path)
    assert first.entry is not None and first.note == ""
    before = _files(tmp_path)
    ids = _ids(lm, 900, 2)
    fill_disk(monkeypatch)
    full = open_document(lm, st, ids, cache_dir=tmp_path)
    assert full.entry is None and full.source == "prefill"
    assert full.note == (f"could not write the prompt cache to {tmp_path / 'entries'}: "
                         f"{NOSPACE} (free disk space, move it with --cache-dir, or use "
                         "--no-cache)")
    answer = [s.token_id for s in full.session.generate(Sampling(max_new_tokens=8))]
    alone = open_document(lm, st, ids, use_cache=False)
    assert answer == [s.token_id for s in alone.session.generate(Sampling(max_new_tokens=8))]
    after = _files(tmp_path)  # no partial entry, no temporary file; the first entry untouched
    assert {k: v for k, v in after.items() if not k.startswith("locks/")} == \
        {k: v for k, v in before.items() if not k.startswith("locks/")}
    assert not [k for k in after if ".tmp-" in k]
    monkeypatch.undo()
    again = open_document(lm, st, _ids(lm, 700, 1), cache_dir=tmp_path)
    assert again.source == "cache" and again.entry == first.entry


def _chat(*args: str, env: dict[str, str] | None = None) -> Any:
    r = CliRunner().invoke(app, ["chat", "-m", str(hf_model("llama")), "-q", "Who?", "-n", "4",
                                 "--temperature", "0", "--json", *args], env=env)
    return r, [json.loads(line)["answer"] for line in r.stdout.splitlines()
               if line.startswith("{")]


def test_the_chat_answers_on_a_full_disk_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(filler_text(600, seed=3))
    r, alone = _chat("-f", str(doc), "--no-cache")
    assert r.exit_code == 0 and alone, r.output
    fill_disk(monkeypatch)
    r, answers = _chat("-f", str(doc), "--cache-dir", str(tmp_path / "cache"))
    assert r.exit_code == 0 and answers == alone, r.output
    said = [line for line in r.stderr.splitlines() if NOSPACE in line]
    assert len(said) == 1 and said[0].startswith("could not write the prompt cache"), r.stderr
    assert "error" not in r.stderr.lower() and "Traceback" not in r.stderr
    assert not list((tmp_path / "cache").rglob("*.ktkv*"))
    r = CliRunner().invoke(app, ["prefill", "-m", str(hf_model("llama")), "-f", str(doc),
                                 "--cache-dir", str(tmp_path / "cache")])
    assert r.exit_code == 2 and r.stderr.count("error:") == 1, r.output
    assert f"error: the prompt cache could not be written: could not write the prompt cache to " \
           f"{tmp_path / 'cache' / 'entries'}: {NOSPACE}" in r.stderr


def test_a_home_that_cannot_be_written_still_chats_with_one_warning(tmp_path: Path) -> None:
    doc = tmp_path / "doc.txt"
    doc.write_text(filler_text(600, seed=4))
    r, alone = _chat("-f", str(doc), "--no-cache")
    assert r.exit_code == 0 and alone, r.output
    (tmp_path / "file").write_text("not a folder")
    home = tmp_path / "file" / "home"
    r, answers = _chat("-f", str(doc), env={"KTLONG_HOME": str(home)})
    assert r.exit_code == 0 and answers == alone, r.output
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: cannot use {home} as the ktlong home: Not a directory: "
                        "default settings, no prompt cache (set KTLONG_HOME to a folder you "
                        "can write to)"], r.stderr
    assert "error" not in r.stderr and "prompt cache" not in r.stderr.replace(warnings[0], "")
    r = CliRunner().invoke(app, ["memcheck", "-m", str(hf_model("llama")), "--write"],
                           env={"KTLONG_HOME": str(home)})
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == [f"error: cannot use {home} as the ktlong home: Not a "
                                     "directory", "hint: set KTLONG_HOME to a folder you can "
                                     "write to"], r.stderr
