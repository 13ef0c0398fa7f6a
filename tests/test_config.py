"""Settings: types, checks, precedence, profiles and the never-clobbered config.yaml."""
from __future__ import annotations

import dataclasses
import os
from importlib import resources
from pathlib import Path

import pytest
import yaml

from ktlong import config, configfile
from ktlong.config import FIELDS, Settings, ensure_config, resolve_settings
from ktlong.errors import KtlongError

# docs/internals.md, "Settings": every key and its default
INTERNALS_DEFAULTS = dict(
    max_seq_len=0, chunk_size=0, kv_type="BF16", kv_tier="AUTO", overflow="SHIFT", device="AUTO",
    weight_type="AUTO",
    prefill_matmul="AUTO",
    threads_num=0,
    attention="SPARSE",
    block_size=128, init_len=128, local_windows_len=4096, second_select_num=96,
    anchor_type="MAX", anchor_num=1, head_select_mode="SHARED", dense_layer_num=0,
    question_blocks=8, question_window=16, question_layers=0, question_positions="NEAR",
    question_votes="NEAR", question_first_block=True,
    block_positions="COMPACT", score_positions="NEAR", select_neighbours=False, spread_blocks=0,
    token_step=1, layer_step=1, layer_budget="UNIFORM", squeeze_ratio=0.5,
    locret_budget=4096, locret_stabilisers=512, locret_scores="HEADS", locret_heads="",
    locret_recall=512,
    preselect_block=False, preselect_block_count=96,
    preselect_window=64, preselect_pool=7, gpu_local_window=True, prefill="AUTO",
    prefill_window=16384, prefill_vertical=1024, prefill_slash=2048, prefill_patterns="",
    max_new_tokens=512,
    temperature=0.0, top_p=1.0, top_k=0, seed=-1, cache_dir="", cache_max_gb=64)
PROFILES = ("default", "dense", "quest", "snapkv", "infllm", "streamingllm", "kvretrieval",
            "small", "ktransformers", "recall", "minference", "squeeze", "locret",
            "locret-attention", "locret-recent", "locret-surprise")


def write_config(home: Path, text: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    path = home / "config.yaml"
    path.write_text(text)
    return path


# --- the typed structure ------------------------------------------------------------------------

def test_every_key_of_internals_with_its_default() -> None:
    assert set(FIELDS) == set(INTERNALS_DEFAULTS)
    s = Settings()
    for key, value in INTERNALS_DEFAULTS.items():
        assert getattr(s, key) == value, key
    for key, spec in FIELDS.items():
        assert spec.description and spec.kind in ("int", "float", "bool", "str", "enum"), key
        assert (spec.kind == "enum") == bool(spec.choices), key


def test_settings_coerce_and_validate_on_construction() -> None:
    s = Settings(kv_type="fp16", block_size="64", preselect_block="yes", max_seq_len="128K")
    assert (s.kv_type, s.block_size, s.preselect_block, s.max_seq_len) == ("FP16", 64, True, 131072)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 32  # type: ignore[misc]
    with pytest.raises(KtlongError, match="multiple of block_size"):
        dataclasses.replace(s, block_size=100)


def test_parse_int_suffixes() -> None:
    assert [config.parse_int(t) for t in ("4096", "4_096", "128K", "1m")] == [4096, 4096, 131072,
                                                                             1048576]
    with pytest.raises(ValueError):
        config.parse_int("12x")


@pytest.mark.parametrize("key,value,words", [
    ("block_size", "big", ["block_size", "int", "'big'"]),
    ("block_size", 0, ["block_size", "out of range", ">= 1"]),
    ("token_step", 0, ["token_step", "out of range"]),
    ("kv_type", "fp8", ["BF16|FP16|FP32"]),
    ("preselect_block", "maybe", ["true|false"]),
    ("temperature", True, ["temperature", "float"]),
    ("top_p", 1.5, ["top_p", "out of range"]),
    ("anchor_num", 2.5, ["anchor_num", "int"]),
    ("cache_max_gb", "nan", ["cache_max_gb", "float"]),
])
def test_wrong_type_or_range(key: str, value: object, words: list[str]) -> None:
    with pytest.raises(KtlongError) as e:
        resolve_settings(overrides={key: value})
    for w in words:
        assert w in e.value.message
    assert e.value.message.startswith("flag: ")


@pytest.mark.parametrize("over,words", [
    ({"anchor_type": "quest"}, ["QUEST needs anchor_num 2", "anchor_num from config:"]),
    ({"local_windows_len": 4000}, ["local_windows_len 4000 is not a multiple of block_size 128"]),
    ({"init_len": 100}, ["init_len 100"]),
    ({"anchor_num": 200}, ["anchor_num 200 is more than block_size 128"]),
    ({"preselect_block": True, "second_select_num": 0}, ["second_select_num is 0"]),
    ({"preselect_block": True, "preselect_block_count": 0}, ["preselect_block_count is 0"]),
    ({"preselect_pool": 4}, ["preselect_pool must be odd"]),
    ({"top_p": 0}, ["top_p must be in (0, 1]"]),
])
def test_cross_field_checks(over: dict, words: list[str]) -> None:
    with pytest.raises(KtlongError) as e:
        resolve_settings(overrides=over)
    for w in words:
        assert w in e.value.message
    assert e.value.hint


def test_cross_field_hints_give_the_fix() -> None:
    with pytest.raises(KtlongError) as e:
        resolve_settings(overrides={"local_windows_len": 4000})
    assert e.value.hint == "set local_windows_len to 3968 or 4096"
    # StreamingLLM: no selected blocks is fine without preselection
    assert resolve_settings(overrides={"second_select_num": 0}).settings.second_select_num == 0


# --- precedence and sources ---------------------------------------------------------------------

def test_precedence_flag_env_profile_config_default(ktlong_home: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_config(ktlong_home, "block_size: 64\nanchor_num: 2\ntop_k: 7\n")
    r = resolve_settings()
    assert r.settings.block_size == 64 and r.sources["block_size"] == f"config:{path}"
    assert r.config_file == path

    r = resolve_settings(profile="quest")
    assert r.settings.block_size == 16 and r.sources["block_size"] == "profile:quest"
    assert r.settings.top_k == 7  # the profile does not touch it

    monkeypatch.setenv("KTLONG_BLOCK_SIZE", "8")
    r = resolve_settings(profile="quest")
    assert r.settings.block_size == 8 and r.sources["block_size"] == "env:KTLONG_BLOCK_SIZE"

    r = resolve_settings(profile="quest", overrides={"block-size": "4", "top_k": None})
    assert r.settings.block_size == 4 and r.sources["block_size"] == "flag"
    assert r.sources["top_k"] == f"config:{path}"  # None means "flag not given"
    assert r.settings.anchor_type == "QUEST" and r.sources["anchor_type"] == "profile:quest"


def test_env_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KTLONG_TOP_P", "abc")
    with pytest.raises(KtlongError, match="environment KTLONG_TOP_P: top_p must be float"):
        resolve_settings()
    monkeypatch.setenv("KTLONG_TOP_P", "")  # empty = unset
    assert resolve_settings().settings.top_p == 1.0


def test_enums_any_case_everywhere(ktlong_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(ktlong_home, "head_select_mode: separate\n")
    monkeypatch.setenv("KTLONG_DEVICE", "cpu")
    s = resolve_settings(overrides={"kv_type": "fp32"}).settings
    assert (s.head_select_mode, s.device, s.kv_type) == ("SEPARATE", "CPU", "FP32")


# --- bad files ----------------------------------------------------------------------------------

def test_unknown_key_names_file_line_and_closest(ktlong_home: Path) -> None:
    path = write_config(ktlong_home, "# mine\nblock_size: 64\nsecond_selct_num: 12\n")
    with pytest.raises(KtlongError) as e:
        resolve_settings()
    assert e.value.message == (f"{path}:3: unknown setting 'second_selct_num'; "
                               "did you mean 'second_select_num'?")
    # nothing appended: the typo's correct key must not appear twice once the user fixes it
    assert path.read_text() == "# mine\nblock_size: 64\nsecond_selct_num: 12\n"
    path.write_text("block_size: 64\nsecond_select_num: 12\n")
    assert resolve_settings().settings.second_select_num == 12
    with pytest.raises(KtlongError, match="flag: unknown setting 'kvtype'; did you mean 'kv_type'"):
        resolve_settings(overrides={"kvtype": "FP16"})


def test_benchmarks_can_leave_config_file_out(ktlong_home: Path) -> None:
    """Benchmarks resolve built-in defaults + profile, whatever config.yaml pins."""
    write_config(ktlong_home, "block_size: 64\nchunk_size: 4096\n")
    assert resolve_settings().settings.chunk_size == 4096
    r = resolve_settings("dense", {"threads_num": 1}, config_file=False)
    assert (r.settings.block_size, r.settings.chunk_size, r.settings.attention) == (128, 0, "DENSE")
    assert r.sources["block_size"] == "default"


def test_wrong_value_in_file_names_line(ktlong_home: Path) -> None:
    path = write_config(ktlong_home, "block_size: 64\n\nchunk_size: lots\n")
    with pytest.raises(KtlongError, match=f"{path}:3: chunk_size must be int >= 0, got 'lots'"):
        resolve_settings()


def test_yaml_syntax_error_reports_line_column_and_leaves_file(ktlong_home: Path) -> None:
    text = "block_size: 64\nanchor_num: [1, 2\n"
    path = write_config(ktlong_home, text)
    before = path.stat().st_mtime_ns
    with pytest.raises(KtlongError) as e:
        resolve_settings()
    assert "YAML syntax error" in e.value.message
    line_col = e.value.message.split(": YAML")[0].removeprefix(str(path) + ":")
    line, col = map(int, line_col.split(":"))
    assert line >= 2 and col >= 1
    assert path.read_text() == text and path.stat().st_mtime_ns == before
    assert sorted(p.name for p in ktlong_home.iterdir()) == ["config.yaml"]


@pytest.mark.parametrize("text,words", [
    ("- block_size\n- 64\n", ["expected `key: value` lines"]),
    ("block_size: 64\nblock_size: 32\n", [":2: 'block_size' is set twice (first on line 1)"]),
    ("block_size: [64]\n", ["block_size must be int"]),
])
def test_malformed_mappings(ktlong_home: Path, text: str, words: list[str]) -> None:
    write_config(ktlong_home, text)
    with pytest.raises(KtlongError) as e:
        resolve_settings()
    for w in words:
        assert w in e.value.message


def test_unusable_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    monkeypatch.setenv("KTLONG_HOME", str(not_a_dir))
    with pytest.raises(KtlongError, match="cannot use .* as the ktlong home") as e:
        ensure_config()
    assert "KTLONG_HOME" in (e.value.hint or "")
    r = resolve_settings()  # a home that cannot be written still runs: defaults, one warning
    assert r.settings == Settings() and r.home_error == e.value.message
    assert r.notes == (f"warning: {e.value.message}: default settings, no prompt cache (set "
                       "KTLONG_HOME to a folder you can write to)",)
    monkeypatch.setenv("KTLONG_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "config.yaml").mkdir(parents=True)
    with pytest.raises(KtlongError, match="cannot read .*config.yaml"):
        resolve_settings()


# --- first run and merging ----------------------------------------------------------------------

def test_first_run_writes_every_key_with_a_comment(ktlong_home: Path) -> None:
    r = resolve_settings()
    path = ktlong_home / "config.yaml"
    text = path.read_text()
    lines = text.splitlines()
    data = yaml.safe_load(text)
    assert list(data) == list(FIELDS)
    for key in FIELDS:
        i = next(n for n, line in enumerate(lines) if line.startswith(f"{key}:"))
        assert lines[i - 1].startswith("# "), key
    assert data["max_seq_len"] == 0 == r.settings.max_seq_len  # what fits the model loaded
    for key, value in INTERNALS_DEFAULTS.items():
        assert data[key] == value, key
    assert not [p for p in ktlong_home.iterdir() if p.name != "config.yaml"]  # no temp files


# what an older first run wrote: a number chosen for an 8B model, with this note above it
OLD_FIRST_RUN = ("# Most tokens the KV cache holds (document + chat) (int 1..16777216)\n"
                 "# chosen from 24.4 GB free DRAM for an 8B model; `ktlong memcheck --model M "
                 "--write` fits it to yours\nmax_seq_len: 44032\n")


def test_an_older_first_run_number_means_auto_and_a_typed_one_stays(ktlong_home: Path) -> None:
    path = write_config(ktlong_home, OLD_FIRST_RUN + "top_k: 3\n")
    r = resolve_settings()
    assert r.settings.max_seq_len == 0 and r.sources["max_seq_len"] == f"config:{path}"
    assert path.read_text().startswith(OLD_FIRST_RUN + "top_k: 3\n")  # never rewritten
    config.write_values(path, {"max_seq_len": "65536"})  # memcheck --write: the number is theirs
    first, _note, _n = OLD_FIRST_RUN.splitlines()
    assert path.read_text().startswith(f"{first}\nmax_seq_len: 65536\ntop_k: 3\n")
    assert resolve_settings().settings.max_seq_len == 65536
    write_config(ktlong_home, "# my own\nmax_seq_len: 44032\n")  # typed: kept as it is
    assert resolve_settings().settings.max_seq_len == 44032


def test_user_edits_survive_and_new_keys_are_appended(ktlong_home: Path) -> None:
    user = "# my settings\nblock_size: 64   # smaller blocks\nkv_type: fp16\n\n\n# end\n"
    path = write_config(ktlong_home, user)
    os.chmod(path, 0o640)
    r = resolve_settings()
    text = path.read_text()
    assert text.startswith(user)
    appended = yaml.safe_load(text[len(user):])
    assert set(appended) == set(FIELDS) - {"block_size", "kv_type"}
    assert "added by ktlong" in text[len(user):]
    assert r.settings.block_size == 64 and r.settings.kv_type == "FP16"
    assert path.stat().st_mode & 0o777 == 0o640
    resolve_settings()  # complete now: nothing more appended
    assert path.read_text() == text


def test_yaml_value_round_trips() -> None:
    for key, spec in FIELDS.items():
        text = f"{key}: {config.yaml_value(spec.default)}\n"
        assert yaml.safe_load(text)[key] == spec.default, key
    assert yaml.safe_load("x: " + config.yaml_value("on"))["x"] == "on"
    assert yaml.safe_load("x: " + config.yaml_value("/a b/c: d"))["x"] == "/a b/c: d"


def test_set_value_edits_one_line(ktlong_home: Path) -> None:
    user = "# top\nblock_size: 64\nmax_seq_len: 1000   # my note\ntop_k: 3\n"
    path = write_config(ktlong_home, user)
    configfile.set_value(path, "max_seq_len", "65536")
    assert path.read_text() == user.replace("1000   # my note", "65536   # my note")
    configfile.set_value(path, "chunk_size", "2048", comment="added")
    assert path.read_text().endswith("# added\nchunk_size: 2048\n")
    bad = write_config(ktlong_home, "max_seq_len: [1\n")
    with pytest.raises(KtlongError, match="YAML syntax error"):
        configfile.set_value(bad, "max_seq_len", "4096")
    assert bad.read_text() == "max_seq_len: [1\n"


# --- profiles -----------------------------------------------------------------------------------

def test_profiles_ship_in_the_package() -> None:
    names = {p.name for p in resources.files("ktlong.profiles").iterdir()}
    assert {f"{n}.yaml" for n in PROFILES} <= names
    assert config.available_profiles() == sorted(PROFILES)


@pytest.mark.parametrize("name", PROFILES)
def test_each_profile_resolves_and_explains_itself(name: str) -> None:
    text = resources.files("ktlong.profiles").joinpath(f"{name}.yaml").read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert len(header) >= 3 and "Trades" in text, name
    data = yaml.safe_load(text)
    r = resolve_settings(profile=name)
    for key, value in data.items():
        assert getattr(r.settings, key) == config.coerce(key, value, name)
        assert r.sources[key] == f"profile:{name}"
        if name not in ("default", "squeeze", "minference"):  # these repeat default's keys; the
            # others hold only the keys they change
            assert config.coerce(key, value, name) != FIELDS[key].default, (name, key)


def test_the_default_profile_is_the_built_in_defaults() -> None:
    """`ktlong chat` with no --profile gets what the `default` profile documents."""
    text = resources.files("ktlong.profiles").joinpath("default.yaml").read_text()
    for key, value in yaml.safe_load(text).items():
        assert config.coerce(key, value, "default") == FIELDS[key].default, key
    assert Settings().question_blocks == 8


def test_a_budget_below_question_blocks_is_theirs_whole() -> None:
    r = resolve_settings(None, {"second_select_num": 4}, config_file=False)
    assert r.settings.question_blocks == 4
    assert resolve_settings("streamingllm", config_file=False).settings.question_blocks == 0
    assert Settings(second_select_num=6, question_blocks=9).question_blocks == 6


def test_profiles_reproduce_their_methods() -> None:
    get = lambda n: resolve_settings(profile=n).settings  # noqa: E731
    assert get("dense").attention == "DENSE"
    q = get("quest")
    assert (q.anchor_type, q.anchor_num, q.head_select_mode, q.preselect_block) == (
        "QUEST", 2, "SEPARATE", False) and q.block_size <= 32
    s = get("snapkv")
    assert s.block_size == 1 and s.preselect_block
    assert get("streamingllm").second_select_num == 0
    k = get("kvretrieval")
    assert k.preselect_block and k.dense_layer_num == 2
    i = get("infllm")
    assert i.anchor_type == "DYNAMIC" and i.anchor_num > 1 and i.init_len > 0
    d = get("default")
    assert (d.block_size, d.local_windows_len, d.second_select_num, d.anchor_type, d.anchor_num,
            d.head_select_mode, d.token_step, d.layer_step, d.preselect_block) == (
        128, 4096, 96, "MAX", 1, "SHARED", 1, 1, False)
    m = get("minference")  # the default's decode, MInference's prefill
    assert m.prefill == "MINFERENCE" and dataclasses.replace(m, prefill=d.prefill) == d
    kt = get("ktransformers")  # KTransformers' own defaults: the default's layout, DYNAMIC anchors
    assert (kt.block_size, kt.second_select_num, kt.anchor_type, kt.anchor_num) == (
        128, 96, "DYNAMIC", 1)
    assert get("kvretrieval").anchor_type == "DYNAMIC"
    r = get("recall")  # the default's layout, Quest's bound per 128-token block
    assert (r.block_size, r.second_select_num, r.anchor_type, r.anchor_num, r.head_select_mode) == (
        128, 96, "QUEST", 2, "SHARED")


def test_profile_by_path_user_folder_and_missing(ktlong_home: Path, tmp_path: Path) -> None:
    mine = tmp_path / "mine.yaml"
    mine.write_text("# my profile\nblock_size: 32\n")
    r = resolve_settings(profile=str(mine))
    assert r.settings.block_size == 32 and r.sources["block_size"] == f"profile:{mine}"

    (ktlong_home / "profiles").mkdir(parents=True)
    (ktlong_home / "profiles" / "quest.yaml").write_text("anchor_type: QUEST\nanchor_num: 2\n")
    r = resolve_settings(profile="quest")  # the user's copy wins over the built-in
    assert r.settings.block_size == 128 and r.settings.anchor_type == "QUEST"

    with pytest.raises(KtlongError) as e:
        resolve_settings(profile="qeust")
    assert "no profile named 'qeust'" in e.value.message and "quest" in e.value.message
    assert all(n in (e.value.hint or "") for n in PROFILES)
    with pytest.raises(KtlongError, match="profile file .*nope.yaml does not exist"):
        resolve_settings(profile=str(tmp_path / "nope.yaml"))

    mine.write_text("blocksize: 32\n")
    with pytest.raises(KtlongError, match=f"{mine}:1: unknown setting 'blocksize'"):
        resolve_settings(profile=str(mine))


def test_a_copied_older_default_in_config_yaml_follows_the_new_default(ktlong_home: Path) -> None:
    """An older first run wrote prefill_window 12288 and prefill WINDOW (then the defaults) into
    config.yaml; they read as today's defaults, so fitting treats them as the user's no more."""
    write_config(ktlong_home, "prefill_window: 12288\nblock_size: 64\nprefill: WINDOW\n")
    r = resolve_settings()
    assert r.settings.prefill_window == FIELDS["prefill_window"].default == 16384
    assert r.sources["prefill_window"].startswith("default (config.yaml's 12288")
    assert r.settings.prefill == FIELDS["prefill"].default == "AUTO"
    assert r.sources["prefill"].startswith("default (config.yaml's WINDOW")
    assert r.settings.block_size == 64 and r.sources["block_size"].startswith("config:")
    write_config(ktlong_home, "prefill_window: 12000\n")  # the user's own number stays
    r = resolve_settings()
    assert r.settings.prefill_window == 12000 and r.sources["prefill_window"].startswith("config:")
    flag = resolve_settings(None, {"prefill_window": 12288})  # a flag is always the user's
    assert flag.settings.prefill_window == 12288 and flag.sources["prefill_window"] == "flag"
