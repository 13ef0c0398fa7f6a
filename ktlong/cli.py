"""The `ktlong` command line (Typer). Each command parses, resolves settings and calls one function.

Heavy modules (torch, transformers, numba) are imported inside commands, so `ktlong --help` is
instant. Every error goes through one handler: a KtlongError prints `error: ...` (+ `hint: ...`) on
stderr and exits 2; anything else prints one line and exits 1; `KTLONG_DEBUG=1` re-raises instead.

Adding a command: write a function with the shared option aliases below, call `resolve(...)`, hand
the settings to the module that does the work.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from ktlong import __version__
from ktlong.bench.e2e import DECODE_RUNS  # stdlib-only at import: --help stays fast
from ktlong.config import (
    CHUNK_AUTO,
    FIELDS,
    Resolved,
    Settings,
    coerce,
    parse_int,
    resolve_settings,
    unknown_key,
)
from ktlong.errors import KtlongError
from ktlong.registry import known, resolve_model


# --- shared options -----------------------------------------------------------------------------
def _model(value: Path | str | None) -> Path | str | None:
    """Every --model goes through here: a known name becomes its GGUF file (ktlong.registry);
    paths pass unchanged (a str option stays a str)."""
    if value is None:
        return None
    path = resolve_model(value)
    return path if isinstance(value, Path) else str(path)


KNOWN_MODELS = ", ".join(known())
ModelOpt = Annotated[Path | None, typer.Option(
    "--model", "-m", metavar="DIR|FILE.gguf|NAME", show_default=False, callback=_model,
    help="Model: a Hugging Face folder (config.json + *.safetensors), a .gguf file, a known "
         f"name ({KNOWN_MODELS}), or a name in ollama, the Hugging Face hub cache or LM Studio "
         "(NAME[:TAG], ORG/REPO[:QUANT]; `ktlong models` lists them).")]
ProfileOpt = Annotated[str | None, typer.Option(
    "--profile", "-p", metavar="NAME|PATH", show_default=False,
    help="Settings profile: default, dense, minference, quest, snapkv, infllm, streamingllm, "
         "kvretrieval, locret, one in $KTLONG_HOME/profiles, or a .yaml path.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON (for scripts).")]
ThreadsOpt = Annotated[int, typer.Option("--threads", "-t", min=0,
                                        help="CPU threads (0 = all cores).")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", metavar="KEY=VALUE", show_default=False,
    help="Set any setting; repeatable. `ktlong inspect config --explain` lists them.")]
MaxSeqLenOpt = Annotated[str | None, typer.Option(
    "--max-seq-len", metavar="TOKENS", show_default=False,
    help="KV cache capacity in tokens, e.g. 131072 or 128K.")]
KvTypeOpt = Annotated[str | None, typer.Option(
    "--kv-type", metavar="BF16|FP16|FP32|Q8_0|Q4_0", show_default=False,
    help="KV cache precision.")]
DeviceOpt = Annotated[str | None, typer.Option(
    "--device", metavar="AUTO|CPU|CUDA", show_default=False, help="Where the model runs.")]
PromptFilesOpt = Annotated[list[str] | None, typer.Option(
    "--prompt-file", "-f", metavar="FILE|DIR|-", show_default=False,
    help="The document: .txt, .md, .pdf, .epub, .html or .docx (PDF: pip install "
         "'ktlong\\[docs]'); repeat it, or give a folder, to read several, each introduced by "
         "its name; - reads stdin.")]
ThreadsOpt = Annotated[int | None, typer.Option(
    "--threads", "-t", show_default=False,
    help="CPU threads (0 = the cores idle when a prefill or an answer starts and every 16 "
         "tokens of an answer, at least the physical cores less one).")]


def overrides(sets: list[str] | None = None, **flags: Any) -> dict[str, Any]:
    """`--set KEY=VALUE` items plus explicit flags (None = not given) as settings overrides."""
    out: dict[str, Any] = {}
    for item in sets or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise KtlongError(f"--set {item!r} is not KEY=VALUE", hint="e.g. --set block_size=64")
        out[key.strip().replace("-", "_")] = value.strip()
    out.update({k: v for k, v in flags.items() if v is not None})
    return out


def resolve(profile: str | None, sets: list[str] | None = None, **flags: Any) -> Resolved:
    return resolve_settings(profile, overrides(sets, **flags))


def fitted(res: Resolved, model: Path | str | None) -> Resolved:
    """`res` fitted to the model (`ktlong.fit`: the sparse budget, max_seq_len 0), its notes on
    stderr; as it is without a model (the command then says it needs one)."""
    if model is None:
        return res
    from ktlong.fit import fit_to_model
    from ktlong.spec import read_spec

    res = fit_to_model(res, read_spec(model, need_weights=False))
    for line in res.notes:
        typer.echo(line, err=True)
    return res


# --- the one error handler ----------------------------------------------------------------------
def _debug() -> bool:
    return os.environ.get("KTLONG_DEBUG", "") not in ("", "0")


def _report(exc: BaseException) -> int:
    """Print one line for `exc` on stderr; return the exit code."""
    if isinstance(exc, KtlongError):
        typer.echo(f"error: {exc.message}", err=True)
        if exc.hint:
            typer.echo(f"hint: {exc.hint}", err=True)
        return 2
    text = str(exc).splitlines()[0] if str(exc) else ""
    typer.echo(f"error: {type(exc).__name__}: {text} (set KTLONG_DEBUG=1 for the traceback)",
               err=True)
    return 1


class _Group(TyperGroup):
    """Root group: turns exceptions from any command into the one-line report."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.TyperException, typer.Exit, typer.Abort):  # usage errors, exits, Ctrl-C
            raise
        except Exception as e:
            if _debug():
                raise
            raise typer.Exit(_report(e)) from None


app = typer.Typer(name="ktlong", cls=_Group, no_args_is_help=True, add_completion=True,
                  pretty_exceptions_show_locals=False,
                  help="Chat with a local LLM about very long documents (128K-1M tokens) using "
                       "block-sparse CPU attention.")
inspect_app = typer.Typer(no_args_is_help=True,
                          help="Show settings, models, prompt caches, what sparse attention reads.")
bench_app = typer.Typer(no_args_is_help=True, help="Measure speed and accuracy.")
tune_app = typer.Typer(no_args_is_help=True, help="Fit settings to a model, offline.")
app.add_typer(inspect_app, name="inspect")
app.add_typer(bench_app, name="bench")
app.add_typer(tune_app, name="tune")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ktlong {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version.")] = False) -> None:
    """Chat with a local LLM about very long documents (128K-1M tokens)."""


# --- memcheck -----------------------------------------------------------------------------------
@app.command()
def memcheck(model: ModelOpt = None, kv_type: KvTypeOpt = None, profile: ProfileOpt = None,
             write: Annotated[bool, typer.Option(
                 "--write", help="Write the recommended max_seq_len, kv_type and kv_tier to "
                                 "config.yaml.")] = False,
             as_json: JsonOpt = False) -> None:
    """How long a context fits: KV cache per length and kv_type, in RAM or on disk.

    Reads only the model's metadata (config.json or GGUF header), never its weights. Compares
    BF16, Q8_0 and Q4_0 unless --kv-type names one.
    """
    from ktlong import memory, render
    from ktlong.config import ensure_config, write_values

    res = resolve(profile, kv_type=kv_type)
    if write and res.home_error:
        ensure_config()  # a home that cannot be written: its one line, before any report
    auto = res.settings.max_seq_len == 0
    if model is not None:
        from ktlong.spec import read_spec

        spec = read_spec(model, need_weights=False)
        res = fitted(res, model)
    else:
        spec = memory.REFERENCE
    free_gpu = None if res.settings.device == "CPU" else memory.free_gpu_bytes()
    folder = memory.tier_folder(res.settings)
    report = memory.report(spec, res.settings.kv_type if kv_type else None,
                           memory.free_dram_bytes(), free_gpu, memory.free_disk_bytes(folder),
                           res.settings, folder)
    written = None
    if write:
        rec = report["recommended"]
        if rec["max_seq_len"] <= 0:
            raise KtlongError("no context length fits in free RAM or on free disk; config.yaml "
                              "left as it is",
                              hint="free memory or disk space, or try --kv-type Q4_0 or a "
                                   "smaller model")
        write_values(res.config_file, {"max_seq_len": str(rec["max_seq_len"]),
                                       "kv_type": rec["kv_type"], "kv_tier": rec["kv_tier"]})
        written = str(res.config_file)
    configured = {k: getattr(res.settings, k) for k in ("max_seq_len", "kv_type", "kv_tier")}
    configured["auto"] = auto
    if as_json:
        render.print_json(report | {"configured_max_seq_len": res.settings.max_seq_len,
                                    "configured": configured, "written": written})
    else:
        render.memcheck(report, configured, written)


# --- chat ---------------------------------------------------------------------------------------
@app.command()
def chat(model: ModelOpt = None,
         prompt_file: PromptFilesOpt = None,
         profile: ProfileOpt = None,
         system: Annotated[str | None, typer.Option(
             "--system", metavar="TEXT", show_default=False, help="System prompt.")] = None,
         max_new_tokens: Annotated[int | None, typer.Option(
             "--max-new-tokens", "-n", show_default=False, help="Most tokens per answer.")] = None,
         temperature: Annotated[float | None, typer.Option(
             show_default=False, help="Sampling temperature; 0 = greedy.")] = None,
         top_p: Annotated[float | None, typer.Option(
             show_default=False, help="Nucleus sampling mass in (0, 1].")] = None,
         top_k: Annotated[int | None, typer.Option(
             show_default=False, help="Sample among the k likeliest tokens; 0 = all.")] = None,
         seed: Annotated[int | None, typer.Option(
             show_default=False, help="Random seed; -1 = random.")] = None,
         questions: Annotated[list[str] | None, typer.Option(
             "--question", "-q", metavar="TEXT", show_default=False,
             help="Answer this and exit (repeatable: answered in order, in one conversation).")]
         = None,
         lead: Annotated[str, typer.Option(
             metavar="TEXT", show_default=False,
             help="Start every answer with TEXT; the model writes on from it (e.g. 'The pass "
                  "key is': a small model is left only the number to write). /lead changes it "
                  "in the chat.")] = "",
         as_json: Annotated[bool, typer.Option(
             "--json", help="One JSON object per answer, one per line (for scripts).")] = False,
         show_prompt_ids: Annotated[bool, typer.Option(
             "--show-prompt-ids", help="Add prompt_ids (the exact ids fed) to --json.")] = False,
         encoding: Annotated[str | None, typer.Option(
             metavar="NAME", show_default=False,
             help="Text encoding of the prompt file and /read files (default UTF-8).")] = None,
         no_cache: Annotated[bool, typer.Option(
             "--no-cache", help="Neither use nor write the prompt cache.")] = False,
         cache_dir: Annotated[Path | None, typer.Option(
             metavar="DIR", show_default=False, help="Prompt cache folder.")] = None,
         sets: SetOpt = None, max_seq_len: MaxSeqLenOpt = None, kv_type: KvTypeOpt = None,
         device: DeviceOpt = None, threads: ThreadsOpt = None,
         demo: Annotated[bool, typer.Option(
             "--demo", help="No model or document needed: the built-in model and a generated "
                            "document with hidden facts (pass key, key-value records, a needle).")]
         = False,
         demo_tokens: Annotated[str, typer.Option(
             metavar="TOKENS", help="Size of the --demo document, e.g. 32K.")] = "16K") -> None:
    """Chat about a long document: read it once, then ask (type /help in the chat)."""
    from ktlong import chat as chat_mod
    from ktlong.promptcache import cache_root

    res = resolve(profile, sets, max_new_tokens=max_new_tokens, temperature=temperature,
                  top_p=top_p, top_k=top_k, seed=seed, max_seq_len=max_seq_len, kv_type=kv_type,
                  device=device, threads_num=threads,
                  cache_dir=str(cache_dir) if cache_dir else None)
    cdir = Path(res.settings.cache_dir).expanduser() if res.settings.cache_dir else None
    no_cache = no_cache or (bool(res.home_error) and cdir is None)  # its warning says so
    if not no_cache:
        cache_root(res.settings, cdir)  # a file, not a folder: refused before anything slow
    files = _documents(prompt_file)
    if demo:
        from ktlong.demo import MODEL_DIR

        st = fitted(res, model or MODEL_DIR).settings
        model, files = _demo_inputs(model, files, demo_tokens, st)
    else:
        st = fitted(res, model).settings
    code = chat_mod.run(model, files, st, system=system, questions=questions or [],
                        as_json=as_json, show_prompt_ids=show_prompt_ids, encoding=encoding,
                        use_cache=not no_cache, cache_dir=cdir, lead=lead)
    if code:
        raise typer.Exit(code)


def _documents(files: list[str] | None) -> str | list[str] | None:
    """--prompt-file as read_document takes it: one source as it is, several as a list."""
    return None if not files else files[0] if len(files) == 1 else files


def _demo_inputs(model: Path | None, prompt_file: str | list[str] | None, tokens: str,
                 st: Settings) -> tuple[Path, str]:
    """`chat --demo`: the shipped model (unless --model) and a generated document; what it
    costs (refused when it does not fit); what to ask."""
    from ktlong import demo

    if prompt_file:
        raise KtlongError("--demo brings its own document; drop --prompt-file",
                          hint="or drop --demo to chat about your file")
    try:
        n = parse_int(tokens)
    except ValueError:
        raise KtlongError(f"--demo-tokens {tokens!r}: expected a number like 16384 or 16K") \
            from None
    exact = st.prefill == "DENSE" or (st.prefill == "WINDOW" and st.prefill_window == 0)
    cost = demo.cost(n, st.kv_type, model, st.threads_num, not exact, st.max_seq_len,
                     settings=st)
    typer.echo(f"demo: {n:,} tokens cost {cost}", err=True)
    d = demo.prepare(n)
    typer.echo(f"demo: a {n:,}-token document ({d.document}) with facts hidden in filler prose; "
               "ask:", err=True)
    for q in d.questions:
        typer.echo(f"  {q}", err=True)
    if model is None:
        typer.echo("note: the built-in demo model (1.1M parameters) finds pass keys up to ~128K "
                   "tokens and needles up to ~64K, but often misses key-value records; "
                   "pass --model for a real one", err=True)
    return model or d.model, str(d.document)


@app.command()
def prefill(model: ModelOpt = None,
            prompt_file: PromptFilesOpt = None,
            profile: ProfileOpt = None, sets: SetOpt = None,
            system: Annotated[str | None, typer.Option(
                "--system", metavar="TEXT", show_default=False,
                help="System prompt (use the same one with chat).")] = None,
            encoding: Annotated[str | None, typer.Option(
                metavar="NAME", show_default=False, help="Text encoding of the document.")] = None,
            cache_dir: Annotated[Path | None, typer.Option(
                "--cache-dir", metavar="DIR", show_default=False,
                help="The prompt cache folder (default: KTLONG_HOME/cache).")] = None,
            max_seq_len: MaxSeqLenOpt = None, kv_type: KvTypeOpt = None,
            device: DeviceOpt = None, threads: ThreadsOpt = None,
            as_json: JsonOpt = False) -> None:
    """Prefill a document once and keep its KV cache on disk: later chats on it start at once."""
    if not prompt_file:
        raise KtlongError("no document given", hint="pass --prompt-file FILE (or - for stdin)")
    from ktlong.prefill import run
    from ktlong.promptcache import cache_root

    res = resolve(profile, sets, max_seq_len=max_seq_len, kv_type=kv_type, device=device,
                  threads_num=threads)
    cache_root(res.settings, cache_dir)  # a file, not a folder: refused before anything slow
    run(model, _documents(prompt_file), fitted(res, model).settings, system=system,
        encoding=encoding,
        cache_dir=cache_dir, as_json=as_json)


# --- serve --------------------------------------------------------------------------------------
@app.command()
def serve(model: ModelOpt = None,
          prompt_file: PromptFilesOpt = None,
          host: Annotated[str, typer.Option(
              help="Address to listen on; anything but loopback wants --api-key.")]
          = "127.0.0.1",
          port: Annotated[int, typer.Option(min=0, max=65535, help="Port.")] = 8080,
          api_key: Annotated[str | None, typer.Option(
              "--api-key", metavar="KEY", show_default=False,
              help="Require 'Authorization: Bearer KEY' on /v1 requests.")] = None,
          name: Annotated[str | None, typer.Option(
              "--name", metavar="ID", show_default=False,
              help="The model id clients send (default: the model's folder or file name).")]
          = None,
          profile: ProfileOpt = None, sets: SetOpt = None,
          encoding: Annotated[str | None, typer.Option(
              metavar="NAME", show_default=False, help="Text encoding of the prompt file.")]
          = None,
          no_cache: Annotated[bool, typer.Option(
              "--no-cache", help="Neither use nor write the prompt cache.")] = False,
          cache_dir: Annotated[Path | None, typer.Option(
              metavar="DIR", show_default=False, help="Prompt cache folder.")] = None,
          max_seq_len: MaxSeqLenOpt = None, kv_type: KvTypeOpt = None,
          device: DeviceOpt = None, threads: ThreadsOpt = None,
          demo: Annotated[bool, typer.Option(
              "--demo", help="Serve the built-in demo model (when no --model).")] = False) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (needs the `serve` extra); a
    --prompt-file document opens every chat, as in `ktlong chat`."""
    from ktlong import server
    from ktlong.promptcache import cache_root

    server.require()
    res = resolve(profile, sets, max_seq_len=max_seq_len, kv_type=kv_type, device=device,
                  threads_num=threads, cache_dir=str(cache_dir) if cache_dir else None)
    cdir = Path(res.settings.cache_dir).expanduser() if res.settings.cache_dir else None
    if not no_cache:
        cache_root(res.settings, cdir)  # a file, not a folder: refused before anything slow
    if demo and model is None:
        from ktlong.demo import MODEL_DIR

        model = MODEL_DIR
    server.run(model, _documents(prompt_file), fitted(res, model).settings, host=host, port=port,
               api_key=api_key, name=name, encoding=encoding, use_cache=not no_cache,
               cache_dir=cdir)


# --- models -------------------------------------------------------------------------------------
@app.command("models")
def models_(profile: ProfileOpt = None, kv_type: KvTypeOpt = None,
            as_json: JsonOpt = False) -> None:
    """The models --model takes by name: ktlong's own, ollama's store, the Hugging Face hub cache
    and LM Studio's folder, each with its size, architecture, quant, trained context and the
    context that fits in free memory."""
    from ktlong.modelstores import list_main

    list_main(resolve(profile, kv_type=kv_type).settings, as_json)


# --- inspect ------------------------------------------------------------------------------------
@inspect_app.command("config")
def inspect_config(keys: Annotated[list[str] | None, typer.Argument(
                       metavar="KEY", show_default=False, help="Only these keys.")] = None,
                   model: Annotated[Path | None, typer.Option(
                       "--model", "-m", metavar="DIR|FILE.gguf|NAME", show_default=False,
                       callback=_model, help="Show the settings fitted to this model (its "
                       "trained context, what fits in free memory).")] = None,
                   profile: ProfileOpt = None, sets: SetOpt = None,
                   max_seq_len: MaxSeqLenOpt = None, kv_type: KvTypeOpt = None,
                   device: DeviceOpt = None, threads: ThreadsOpt = None,
                   explain: Annotated[bool, typer.Option(
                       "--explain", help="Add each key's allowed values and meaning.")] = False,
                   as_json: JsonOpt = False) -> None:
    """Effective settings and where each value came from (flag, env, profile, config, default;
    with --model: fitted to it)."""
    from ktlong import render

    for key in keys or []:
        if key not in FIELDS:
            raise unknown_key(key, "inspect config")
    res = fitted(resolve(profile, sets, max_seq_len=max_seq_len, kv_type=kv_type, device=device,
                         threads_num=threads), model)
    if as_json:
        shown = keys or list(FIELDS)
        data: dict[str, Any] = {
            "settings": {k: getattr(res.settings, k) for k in shown},
            "sources": {k: res.sources[k] for k in shown},
            "config_file": str(res.config_file)}
        if explain:
            data["fields"] = {k: {"kind": FIELDS[k].kind, "allowed": FIELDS[k].allowed(),
                                  "default": FIELDS[k].default,
                                  "description": FIELDS[k].description} for k in shown}
        render.print_json(data)
    else:
        render.settings(res, explain, keys)


@inspect_app.command("model")
def inspect_model(model: Annotated[Path | None, typer.Argument(
                      metavar="DIR|FILE.gguf|NAME", show_default=False, callback=_model,
                      help="A Hugging Face folder (config.json + *.safetensors), a .gguf file, "
                           f"or a known name: {KNOWN_MODELS} (or give it as --model).")] = None,
                  model_opt: ModelOpt = None,
                  profile: ProfileOpt = None, kv_type: KvTypeOpt = None,
                  as_json: JsonOpt = False) -> None:
    """Architecture, heads, RoPE, weight types and KV bytes per token, from metadata only.

    Reads config.json and the safetensors headers (or the GGUF header); never loads the weights.
    """
    from ktlong.inspect import show_model

    if (model is None) == (model_opt is None):
        raise KtlongError("inspect model: give the model once, as an argument or as --model",
                          hint="e.g. ktlong inspect model smollm2")
    model = model or model_opt
    show_model(model, resolve(profile, kv_type=kv_type).settings.kv_type, as_json)


@inspect_app.command("attention")
def inspect_attention(prompt_file: Annotated[Path, typer.Option(
                          "--prompt-file", "-f", metavar="FILE", show_default=False,
                          help="The document, a UTF-8 text file.")],
                      question: Annotated[str, typer.Option(
                          "--question", "-q", show_default=False, help="The question asked.")],
                      model: ModelOpt = None, profile: ProfileOpt = None, sets: SetOpt = None,
                      tokens: Annotated[int, typer.Option(
                          "--tokens", "-n", min=1, help="Answer tokens to observe.")] = 8,
                      png: Annotated[Path | None, typer.Option(
                          "--png", metavar="FILE", show_default=False,
                          help="Also write the map and a recall-by-layer plot as an image "
                               "(needs matplotlib).")] = None,
                      max_seq_len: MaxSeqLenOpt = None, kv_type: KvTypeOpt = None,
                      device: DeviceOpt = None, threads: ThreadsOpt = None,
                      as_json: JsonOpt = False) -> None:
    """How much of the exact attention the profile's block selection keeps, layer by layer.

    Per layer over the first answer tokens: recall, overlap of steps, a map of blocks read.
    """
    from ktlong.inspect import attention_main

    res = resolve(profile, sets, max_seq_len=max_seq_len, kv_type=kv_type, device=device,
                  threads_num=threads)
    attention_main(model, prompt_file, question, fitted(res, model).settings, profile, tokens,
                   as_json, png)


@inspect_app.command("document")
def inspect_document(files: Annotated[list[str], typer.Argument(
                         metavar="FILE|DIR...", show_default=False,
                         help="Documents as --prompt-file takes them (several are joined).")],
                     model: Annotated[Path | None, typer.Option(
                         "--model", "-m", metavar="DIR|FILE.gguf|NAME", show_default=False,
                         callback=_model, help="Count tokens with this model's tokenizer (else "
                         f"an estimate); a path or a known name: {KNOWN_MODELS}.")]
                     = None,
                     encoding: Annotated[str | None, typer.Option(
                         metavar="NAME", show_default=False,
                         help="Text encoding of text and HTML files (default UTF-8).")] = None,
                     show: Annotated[bool, typer.Option(
                         "--show", help="Print the text the model reads (on stdout; the summary "
                                        "goes to stderr).")] = False,
                     as_json: JsonOpt = False) -> None:
    """The text that goes to the model: per file its kind, pages, characters, tokens, and what
    was dropped (pages without text, images, scripts and styles)."""
    from ktlong.inspect import document_main

    document_main(files, model, encoding, show, as_json)


@inspect_app.command("cache")
def inspect_cache(remove: Annotated[list[str] | None, typer.Option(
                      "--remove", metavar="KEY|NAME|all", show_default=False,
                      help="Remove these entries (a key prefix, a saved name, or all).")] = None,
                  cache_dir: Annotated[Path | None, typer.Option(
                      "--cache-dir", metavar="DIR", show_default=False,
                      help="The prompt cache folder (default: KTLONG_HOME/cache).")] = None,
                  as_json: JsonOpt = False) -> None:
    """Prompt-cache entries (model, tokens, size, last used); --remove deletes some."""
    from ktlong import render
    from ktlong.promptcache import list_entries, remove_entries

    settings = resolve(None).settings
    removed = remove_entries(settings, remove, cache_dir) if remove else []
    rows = list_entries(settings, cache_dir)
    if as_json:
        render.print_json({"entries": rows, "removed": removed})
    else:
        render.cache_entries(rows, removed)


# --- tune -------------------------------------------------------------------------------------
@tune_app.command("prefill")
def tune_prefill(model: ModelOpt = None,
                 prompt_file: Annotated[str | None, typer.Option(
                     "--prompt-file", "-f", metavar="FILE", show_default=False,
                     help="A sample document like yours (default: a generated demo document).")]
                 = None,
                 tokens: Annotated[str, typer.Option(
                     help="Tokens of the sample to use (K suffix allowed).")] = "16K",
                 budget: Annotated[int, typer.Option(
                     min=0, help="Keys a query may read, the same for every candidate "
                                   "(default: prefill_vertical + prefill_slash).")] = 0,
                 queries: Annotated[int, typer.Option(
                     min=64, help="Last queries of the sample whose exact attention is "
                                  "compared.")] = 1024,
                 out: Annotated[Path | None, typer.Option(
                     "--out", metavar="FILE", show_default=False,
                     help="Write here instead of next to the model's settings "
                          "(KTLONG_HOME/patterns).")] = None,
                 profile: ProfileOpt = None, sets: SetOpt = None, threads: ThreadsOpt = None,
                 as_json: JsonOpt = False) -> None:
    """Choose each attention head's sparse prefill pattern (MInference) for a model.

    Prefills a sample exactly, then keeps per head the pattern (A-shape, Vertical-Slash or
    Block-Sparse, each at about --budget keys a query) that keeps most of the exact attention.
    `prefill: minference` then uses the file for this model.
    """
    from ktlong.tune import main as tune_main

    st = resolve(profile, sets, threads_num=threads).settings
    tune_main(model, prompt_file, st, _lengths(tokens, "--tokens")[0],
              budget or st.prefill_vertical + st.prefill_slash, queries, out, as_json)


@app.command("train-heads")
def train_heads(model: ModelOpt = None,
                docs: Annotated[int, typer.Option(
                    min=1, help="Training documents (each read once, asked --questions).")] = 160,
                doc_tokens: Annotated[str, typer.Option(
                    help="Tokens per training document (K suffix allowed).")] = "1536",
                questions: Annotated[int, typer.Option(min=1, help="Questions per document.")]
                = 2,
                out: Annotated[Path | None, typer.Option(
                    "--out", metavar="FILE", show_default=False,
                    help="Write here instead of next to the settings (KTLONG_HOME/heads).")]
                = None,
                fresh: Annotated[bool, typer.Option(
                    "--fresh", help="Start over instead of resuming a stopped run.")] = False,
                threads: ThreadsOpt = None, as_json: JsonOpt = False) -> None:
    """Train a model's Locret retaining heads (for `attention: LOCRET`, profile locret).

    The model stays frozen: it reads real text (the license texts and Python's documentation on
    this machine), answers questions about it, and small heads learn which tokens its answers
    attend to most. A stopped run resumes where it was.
    """
    from ktlong.trainheads import TrainConfig
    from ktlong.trainheads import main as train_main

    if model is None:
        raise KtlongError("train-heads needs --model", hint="e.g. ktlong train-heads -m smollm2")
    cfg = TrainConfig(docs=docs, doc_tokens=_lengths(doc_tokens, "--doc-tokens")[0],
                      questions=questions)
    train_main(model, out, cfg, fresh, threads or 0, as_json)


# --- bench --------------------------------------------------------------------------------------
PlotOpt = Annotated[Path | None, typer.Option(
    "--plot", metavar="FILE.png", show_default=False,
    help="Also draw the results as a PNG (needs matplotlib: pip install 'ktlong\\[bench]'); "
         "`ktlong bench plot` redraws a saved --json.")]
PngOpt = Annotated[Path | None, typer.Option("--png", hidden=True, show_default=False,
                                             help="Old name of --plot.")]


def _plot_file(plot: Path | None, png: Path | None = None) -> Path | None:
    """--plot (or its old name --png); refused at once when matplotlib is missing."""
    path = plot or png
    if path is not None:
        from ktlong.bench.plot import require

        require()
    return path


def _lengths(contexts: str, option: str = "--contexts") -> list[int]:
    try:
        lengths = [parse_int(x) for x in contexts.split(",") if x.strip()]
    except ValueError:
        raise KtlongError(f"{option} {contexts!r}: expected numbers like 16384,64K,1M") from None
    if not lengths or min(lengths) <= 0:
        raise KtlongError(f"{option} {contexts!r}: give at least one positive length")
    return lengths


@bench_app.command("decode")
def bench_decode(contexts: Annotated[str, typer.Option(
                     help="Context lengths, comma-separated (K and M suffixes allowed).")]
                 = "16384,65536,131072,262144,1048576",
                 repeats: Annotated[int, typer.Option(
                     min=1, help="Rounds; each times every path at every length once.")] = 5,
                 threads: ThreadsOpt = 0,
                 quest: Annotated[bool, typer.Option(
                     "--quest", help="Score blocks by Quest's min/max bound (2 anchors, the "
                                     "recall profile) instead of one anchor (default).")] = False,
                 kv_type: Annotated[str, typer.Option(
                     help="KV formats, comma-separated: BF16, FP16, Q8_0, Q4_0 (each timed "
                          "in the same rounds).")] = "BF16",
                 kv_tier: Annotated[str, typer.Option(
                     help="With --shape or -m: ram, or disk (the KV in a file under cache_dir, "
                          "memory-mapped).")] = "ram",
                 shape: Annotated[str | None, typer.Option(
                     show_default=False,
                     help="Decode a whole random model at real widths (8b) over a synthetic KV "
                          "cache of each --contexts length instead of one layer's attention.")]
                 = None,
                 model: ModelOpt = None,
                 layers: Annotated[int, typer.Option(min=1, help="Layers of the --shape model.")]
                 = 2,
                 weights: Annotated[str, typer.Option(
                     help="Weights of the --shape model (as bench e2e).")] = "q4_k_m",
                 steps: Annotated[int, typer.Option(
                     min=2, help="With --shape or -m: tokens decoded per run.")] = 16,
                 runs: Annotated[int, typer.Option(
                     min=1, help="With --shape or -m: decode runs (the median is reported).")] = 3,
                 profiles: Annotated[str, typer.Option(
                     help="With --shape or -m: settings profiles (names or YAML files), "
                          "comma-separated, each in its own process.")] = "default",
                 kv: Annotated[str, typer.Option(
                     help="With -m: prose (a chat's KV: real prose read by ktlong's prefill, "
                          "or the prompt cache) or random (random rows, a kernel figure). "
                          "--shape always decodes over random rows.")] = "prose",
                 prompt_file: Annotated[list[str] | None, typer.Option(
                     "--prompt-file", "-f", show_default=False,
                     help="With -m: documents to decode over, each read whole as the chat reads "
                          "it (one context each, instead of --contexts); repeat it.")] = None,
                 peers: Annotated[str, typer.Option(
                     help="With --shape or -m: llama.cpp runtimes decoding the same file over the "
                          "same ids, read by its own prefill (--shape, --kv random: a synthetic "
                          "KV of the same length), comma-separated: llamacpp-fa (F16 "
                          "KV), llamacpp-q8kv (Q8_0 KV), llamacpp-nofa (no flash attention); "
                          "needs the [peers] extra.")] = "",
                 plot: PlotOpt = None, as_json: JsonOpt = False) -> None:
    """Sparse decode speed against context length: one layer's attention (kernels only), or a
    whole model over a synthetic KV cache (--shape, or a real model with --model)."""
    lengths = _lengths(contexts)
    kv_types = list(dict.fromkeys(t.strip().upper() for t in kv_type.split(",") if t.strip()))
    bad = [t for t in kv_types if t not in ("BF16", "FP16", "Q8_0", "Q4_0")]
    if bad or not kv_types:
        raise KtlongError(f"--kv-type {kv_type!r}: choose from BF16, FP16, Q8_0, Q4_0")
    if kv_tier not in ("ram", "disk"):
        raise KtlongError(f"--kv-tier {kv_tier!r}: choose ram or disk")
    if shape is not None and model is not None:
        raise KtlongError("--shape and --model both name a model: give one")
    if kv not in ("prose", "random"):
        raise KtlongError(f"--kv {kv!r}: choose prose or random")
    if prompt_file and (model is None or kv != "prose"):
        raise KtlongError("--prompt-file is what a real model's chat reads: add -m, drop --kv")
    if model is not None and kv == "prose" and kv_tier != "ram":
        raise KtlongError("--kv-tier disk decodes random rows", hint="add --kv random")
    if shape is not None or model is not None:
        from ktlong.bench import decodemodel
        from ktlong.bench.genmodel import SHAPES, WEIGHTS

        if model is not None:
            from ktlong.spec import read_spec

            read_spec(model)  # a missing or unreadable model: one line, before any worker
        elif shape not in SHAPES or weights not in WEIGHTS:
            raise KtlongError(f"--shape {shape} --weights {weights}: choose a shape from "
                              f"{list(SHAPES)} and weights from {', '.join(WEIGHTS)}")
        cache = resolve(None).settings.cache_dir
        names = tuple(p.strip() for p in profiles.split(",") if p.strip()) or ("default",)
        peer_names = tuple(p.strip() for p in peers.split(",") if p.strip())
        bad = [p for p in peer_names if p not in decodemodel.PEERS]
        if bad:
            raise KtlongError(f"--peers {', '.join(bad)}: unknown",
                              hint=f"choose from {', '.join(decodemodel.PEERS)}")
        if peer_names:
            from ktlong.bench.e2e import PEERS_HINT, _llamacpp_available

            if not _llamacpp_available():
                raise KtlongError("--peers needs llama-cpp-python", hint=PEERS_HINT)
        data = decodemodel.run(lengths, kv_types, kv_tier, steps, runs, threads,
                               Path(model) if model is not None else (shape, layers, weights),
                               cache, lambda m: print(m, file=sys.stderr, flush=True), names,
                               peer_names, kv, tuple(str(Path(f).resolve())
                                                     for f in prompt_file or ()))
        what = (f"-m {model.name}" if model is not None
                else f"--shape {shape} --layers {layers} --weights {weights}")
        docs = "".join(f" -f {f}" for f in prompt_file or ())
        data["command"] = (f"ktlong bench decode {what}{' --kv random' if kv == 'random' else ''}"
                           f"{docs or f' --contexts {contexts}'} --kv-type {','.join(kv_types)} "
                           f"--kv-tier {kv_tier} --steps {steps} --runs {runs}"
                           f"{f' --profiles {profiles}' if profiles != 'default' else ''}"
                           f"{f' --peers {peers}' if peer_names else ''}"
                           f"{f' -t {threads}' if threads else ''}")
        if as_json:
            import json

            print(json.dumps(data))
        else:
            decodemodel.print_table(data)
        return
    if kv_tier != "ram":
        raise KtlongError("--kv-tier disk needs --shape (the kernel bench keeps its KV in RAM)")
    plot_file = _plot_file(plot)
    from ktlong.bench import decode

    types = "" if kv_types == ["BF16"] else f" --kv-type {','.join(kv_types)}"
    command = (f"ktlong bench decode --contexts {contexts.replace(' ', '')} --repeats {repeats}"
               f"{f' -t {threads}' if threads else ''}{' --quest' if quest else ''}{types}")
    decode.main(contexts=lengths, repeats=repeats, threads=threads, as_json=as_json,
                quest=quest, plot_file=plot_file, command=command, kv_types=kv_types)


@bench_app.command("gemv")
def bench_gemv(types: Annotated[str, typer.Option(
                   help="Weight types, comma-separated: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1, F16.")]
               = "Q4_K,Q6_K,Q8_0,Q4_0,F16",
               repeats: Annotated[int, typer.Option(
                   min=1, help="Rounds; each times the GEMVs and the bandwidth probe once.")] = 7,
               threads: ThreadsOpt = 0,
               as_json: JsonOpt = False) -> None:
    """Decode GEMV over quantised 8B-width weights: GB/s of weight bytes against the machine's
    streaming bandwidth."""
    from ktlong.bench import gemv

    names = [t.strip().upper() for t in types.split(",") if t.strip()]
    bad = [t for t in names if t not in gemv.TYPES]
    if bad or not names:
        raise KtlongError(f"--types: unknown weight type {bad[0] if bad else types!r}",
                          hint=f"choose from {', '.join(gemv.TYPES)}")
    gemv.main(names, repeats, threads, as_json)


@bench_app.command("step")
def bench_step(model: Annotated[str, typer.Option(
                   "--model", "-m", show_default=False, callback=_model,
                   help="A model folder or GGUF file, or a packaged model's name.")],
               context: Annotated[str, typer.Option(
                   help="Prompt tokens of real prose before the decode (K suffix allowed).")]
               = "4K",
               steps: Annotated[int, typer.Option(min=4, help="Tokens decoded per run.")] = 64,
               runs: Annotated[int, typer.Option(
                   min=1, help="Decode runs from the same point (the median is reported).")]
               = 3,
               profile: ProfileOpt = "default",
               threads: ThreadsOpt = 0,
               as_json: JsonOpt = False) -> None:
    """Where a decode step's time goes (GEMVs, attention, head, the rest, sampling), against
    the bytes it must read over the machine's streaming bandwidth."""
    from ktlong.bench import step

    n = _lengths(context)[0]
    command = (f"ktlong bench step -m {model} --context {context} --steps {steps} --runs {runs}"
               f"{f' --profile {profile}' if profile != 'default' else ''}"
               f"{f' -t {threads}' if threads else ''}")
    step.main(model, n, steps, runs, profile, threads, as_json, command)


@bench_app.command("prefill")
def bench_prefill(contexts: Annotated[str, typer.Option(
                      help="Context lengths, comma-separated (K and M suffixes allowed).")]
                  = "8192,32768",
                  model: ModelOpt = None,
                  modes: Annotated[str, typer.Option(
                      help="ktlong prefill modes to compare, comma-separated: dense, window, "
                           "minference.")] = "dense",
                  shape: Annotated[str, typer.Option(
                      help="Random model without --model: small (4 layers, hidden 512) or 8b "
                           "(Llama-3-8B widths, 2 layers).")] = "small",
                  sample_chunks: Annotated[int, typer.Option(
                      min=0, help="Time only this many chunks per context, spread evenly, over "
                                  "random K, V, and scale up (0 = prefill everything).")] = 0,
                  transformers: Annotated[bool, typer.Option(
                      "--transformers/--no-transformers",
                      help="Also time transformers' one-shot forward.")] = True,
                  threads: ThreadsOpt = 0,
                  chunk_sizes: Annotated[str, typer.Option(
                      help="ktlong's prefill chunk sizes to compare, comma-separated "
                           "(default: the size ktlong prefills with on the CPU).")]
                  = str(CHUNK_AUTO[False]),
                  peers: Annotated[str, typer.Option(
                      help="With a GGUF --model: llama.cpp reading the same ids of the same file "
                           "(sampled as ktlong is, over a synthetic KV), comma-separated: "
                           "llamacpp-fa, llamacpp-nofa (flash attention on / off); needs the "
                           "[peers] extra.")] = "",
                  plot: PlotOpt = None, as_json: JsonOpt = False) -> None:
    """Prefill tok/s, attention time and peak RSS per prefill mode, and against transformers
    and llama.cpp."""
    plot_file = _plot_file(plot)
    from ktlong.bench import prefill

    names = tuple(m.strip().lower() for m in modes.split(",") if m.strip())
    bad = [m for m in names if m not in prefill.MODES] + (
        [] if shape in prefill.SHAPES else [f"shape {shape}"])
    if bad or not names:
        raise KtlongError(f"--modes {modes!r} / --shape {shape!r}: unknown {', '.join(bad)}",
                          hint=f"modes: {', '.join(prefill.MODES)}; shapes: "
                               f"{', '.join(prefill.SHAPES)}")
    chunks = tuple(_lengths(chunk_sizes, "--chunk-sizes"))
    peer_names = tuple(dict.fromkeys(p.strip() for p in peers.split(",") if p.strip()))
    if peer_names:
        bad = [p for p in peer_names if p not in prefill.PEERS]
        if bad:
            raise KtlongError(f"--peers {', '.join(bad)}: unknown",
                              hint=f"choose from {', '.join(prefill.PEERS)}")
        from ktlong.spec import read_spec

        if model is None or read_spec(model, need_weights=False).format != "gguf":
            raise KtlongError("--peers reads a GGUF file: give it as --model FILE.gguf")
        from ktlong.bench.e2e import PEERS_HINT, _llamacpp_available

        if not _llamacpp_available():
            raise KtlongError("--peers needs llama-cpp-python", hint=PEERS_HINT)
    command = (f"ktlong bench prefill --contexts {contexts} --modes {','.join(names)}"
               f"{f' --model {model}' if model else f' --shape {shape}'}"
               f"{f' --sample-chunks {sample_chunks}' if sample_chunks else ''}"
               f"{'' if transformers else ' --no-transformers'}"
               f"{' --peers ' + ','.join(peer_names) if peer_names else ''}"
               f"{f' -t {threads}' if threads else ''} --chunk-sizes {chunk_sizes}")
    prefill.main(_lengths(contexts), threads, as_json, model, chunks, names, transformers, shape,
                 sample_chunks, command, plot_file, peer_names)


@bench_app.command("accuracy")
def bench_accuracy(model: ModelOpt = None,
                   lengths: Annotated[str, typer.Option(
                       help="Document lengths in tokens, comma-separated (K suffix allowed).")]
                   = "2K,4K,16K,32K",
                   samples: Annotated[int, typer.Option(
                       min=1, help="Documents per length (each asks every task once).")] = 20,
                   profiles: Annotated[str, typer.Option(
                       help="Profiles to compare, comma-separated; llamacpp and llamacpp-yarn "
                            "add llama.cpp on the same GGUF (plain, and YaRN past the trained "
                            "context).")]
                   = "dense,default,quest,kvretrieval,streamingllm",
                   task_list: Annotated[str, typer.Option(
                       "--tasks", help="Tasks to ask, comma-separated: passkey, kv, needle, "
                       "multineedle (several needles in one document, one asked).")]
                   = "passkey,kv,needle",
                   haystack: Annotated[str, typer.Option(
                       help="What the facts hide in: filler (random words, what the demo model "
                            "was trained on), prose (a generated story), real (license texts and "
                            "Python's documentation: text nobody here wrote) or licenses (the "
                            "license texts alone).")] = "filler",
                   lead: Annotated[bool, typer.Option(
                       "--lead", help="Start each answer with the reference answer's words "
                       "before the value (\"The pass key is\"), as pass key benchmarks do for "
                       "pretrained models: the model only writes the value.")] = False,
                   plot: PlotOpt = None, png: PngOpt = None,
                   seed: Annotated[int, typer.Option(help="Seed of the generated documents.")] = 0,
                   threads: ThreadsOpt = 0, device: DeviceOpt = None,
                   save: Annotated[Path | None, typer.Option(
                       "--save", metavar="FILE", help="Also write the JSON result here after "
                       "every document, so a long run that stops keeps what it finished "
                       "(`ktlong bench plot FILE` draws it).")] = None,
                   only: Annotated[str, typer.Option(
                       "--only", metavar="I,J", help="Run just these of the --samples documents "
                       "(0-based, comma-separated): the same documents as in the whole run, "
                       "e.g. to read again one that missed.")] = "",
                   as_json: JsonOpt = False) -> None:
    """Passkey, kv-retrieval and needle accuracy per profile and length (default: demo model)."""
    if save is not None and (save.is_dir() or not save.parent.is_dir()
                             or not os.access(save.parent, os.W_OK)):
        why = ("a folder" if save.is_dir() else f"no folder {save.parent}"
               if not save.parent.is_dir() else f"cannot write in {save.parent}")
        raise KtlongError(f"--save {save}: {why}", hint="give a file path in a writable folder")
    from ktlong.demo import tasks

    task_names = list(dict.fromkeys(t.strip().lower() for t in task_list.split(",") if t.strip()))
    bad = [t for t in task_names if t not in tasks.ALL_TASKS]
    if bad or not task_names:
        raise KtlongError(f"--tasks {task_list!r}: "
                          + (f"unknown {', '.join(bad)}" if bad else "no task given"),
                          hint=f"tasks: {', '.join(tasks.ALL_TASKS)}")
    if haystack not in tasks.HAYSTACKS:
        raise KtlongError(f"--haystack {haystack!r}: unknown",
                          hint=f"haystacks: {', '.join(tasks.HAYSTACKS)}")
    plot_file = _plot_file(plot, png)
    picks = [x.strip() for x in only.split(",") if x.strip()]
    if any(not x.isdigit() or int(x) >= samples for x in picks):
        raise KtlongError(f"--only {only!r}: not sample numbers below --samples {samples}",
                          hint="give 0-based numbers, e.g. --samples 3 --only 0,2")
    from ktlong.demo import accuracy

    names = [p.strip() for p in profiles.split(",") if p.strip()]
    for p in names:
        if p not in accuracy.PEERS:
            resolve_settings(p, {})  # an unknown profile fails here, before loading anything
    if set(names) & set(accuracy.PEERS):
        from ktlong.spec import read_spec

        if model is None or read_spec(model, need_weights=False).format != "gguf":
            raise KtlongError("--profiles llamacpp / llamacpp-yarn run llama.cpp on a GGUF file",
                              hint="pass --model with a .gguf file (e.g. -m smollm2)")
        from ktlong.bench.e2e import PEERS_HINT, _llamacpp_available

        if not _llamacpp_available():
            raise KtlongError("--profiles llamacpp needs llama-cpp-python", hint=PEERS_HINT)
    asked = ",".join(task_names)
    command = (f"ktlong bench accuracy{f' --model {model}' if model else ''} --lengths {lengths} "
               f"--samples {samples} --profiles {','.join(names)}"
               f"{'' if task_names == list(tasks.TASKS) else f' --tasks {asked}'}"
               f"{'' if haystack == 'filler' else f' --haystack {haystack}'}"
               f"{' --lead' if lead else ''}{f' --seed {seed}' if seed else ''}"
               f"{f' --only {only}' if picks else ''}"
               f"{f' -t {threads}' if threads else ''}{f' --device {device}' if device else ''}")
    accuracy.main(model, _lengths(lengths), samples, names, as_json, plot_file, threads, seed,
                  command, task_names, haystack, lead, device=coerce("device", device or "AUTO",
                                                                     "--device"), save=save,
                  only=[int(x) for x in picks])


@bench_app.command("cache")
def bench_cache(contexts: Annotated[str, typer.Option(
                    help="Context lengths, comma-separated (K and M suffixes allowed).")]
                = "32768,131072",
                rss_gb: Annotated[float, typer.Option(
                    "--rss-gb", min=0.0, help="Instead: decode from a synthetic entry of this "
                    "many GB and report peak RSS against its size.")] = 0.0,
                plot: PlotOpt = None, as_json: JsonOpt = False) -> None:
    """Time to first token: prompt-cache hit against a fresh prefill; decode from mmap vs RAM."""
    if rss_gb and plot is not None:
        raise KtlongError("--plot draws time to first token; --rss-gb has no figure",
                          hint="drop one of them")
    lengths = [] if rss_gb else _lengths(contexts)
    plot_file = _plot_file(plot)
    from ktlong.bench import cache

    if rss_gb:
        cache.rss_check(rss_gb, as_json)
    else:
        cache.main(lengths, as_json, plot_file,
                   command=f"ktlong bench cache --contexts {contexts.replace(' ', '')}")


@bench_app.command("e2e")
def bench_e2e(contexts: Annotated[str, typer.Option(
                  help="Context lengths, comma-separated (K and M suffixes allowed).")]
              = "4K,16K,32K,64K",
              new_tokens: Annotated[int, typer.Option(
                  min=2, help="Tokens decoded per run (EOS does not stop it).")] = 64,
              runtimes: Annotated[str, typer.Option(
                  help="Runtimes, comma-separated: ktlong-default, ktlong-dense, transformers, "
                       "llamacpp (flash attention on, KV F16 and Q8_0; needs the peers extra), "
                       "or one of llamacpp-fa, llamacpp-q8kv, llamacpp-nofa.")]
              = "ktlong-default,ktlong-dense,transformers,llamacpp",
              repeats: Annotated[int, typer.Option(
                  min=1, help="Interleaved rounds (every other one in reverse order); medians "
                              "are reported, and per round ktlong's median decode run over "
                              "llama.cpp's best.")] = 1,
              decode_runs: Annotated[int, typer.Option(
                  min=1, help="Decode runs per prefill (the prompt's last token re-fed); "
                              "the median is reported.")] = DECODE_RUNS,
              plot: PlotOpt = None, png: PngOpt = None,
              threads: Annotated[int, typer.Option(
                  "--threads", "-t", min=0,
                  help="CPU threads (0: ktlong takes the idle cores, the peers all cores).")] = 0,
              model: Annotated[str | None, typer.Option(
                  "--model", "-m", show_default=False, callback=_model,
                  help="Your own model: a GGUF file (ktlong vs llama.cpp on the same file) or an "
                       f"HF folder (ktlong vs transformers), or a known name: {KNOWN_MODELS}.")]
              = None,
              shape: Annotated[str | None, typer.Option(
                  show_default=False,
                  help="A random model at real widths, as one GGUF file read by ktlong and "
                       "llama.cpp: 8b (Llama-3.1-8B's widths). Kept under "
                       "KTLONG_HOME/bench-models for later runs.")] = None,
              layers: Annotated[int, typer.Option(
                  min=1, help="Layers of the --shape model.")] = 6,
              weights: Annotated[str, typer.Option(
                  help="Weights of the --shape model: q4_k_m, q8_0, q6_k or f16 (quantised by "
                       "llama.cpp's quantizer when llama-cpp-python is installed, else by "
                       "ktlong's).")] = "q4_k_m",
              kv_type: Annotated[str, typer.Option(
                  help="ktlong's KV format: BF16, FP16, FP32, Q8_0 or Q4_0 (llama.cpp's runtimes "
                       "keep their own: F16, Q8_0 for llamacpp-q8kv).")] = "BF16",
              kv_tier: Annotated[str, typer.Option(
                  help="Where ktlong's KV lives: ram, or disk (a file under cache_dir, "
                       "memory-mapped).")] = "ram",
              as_json: JsonOpt = False) -> None:
    """Prefill, decode and peak RSS: ktlong vs transformers and llama.cpp, on one random Llama,
    a random model at real widths (--shape), or your own (--model)."""
    plot_file = _plot_file(plot, png)
    from ktlong.bench import e2e
    from ktlong.bench.genmodel import SHAPES, WEIGHTS

    if shape is not None and shape not in SHAPES:
        raise KtlongError(f"--shape: unknown shape {shape!r}", hint=f"choose from {list(SHAPES)}")
    if weights not in WEIGHTS:
        raise KtlongError(f"--weights: unknown recipe {weights!r}",
                          hint=f"choose from {', '.join(WEIGHTS)}")
    if shape is not None and model is not None:
        raise KtlongError("--shape and --model exclude each other",
                          hint="bench a random model at real widths, or your own, not both")
    kv_type = kv_type.strip().upper()
    if kv_type not in ("BF16", "FP16", "FP32", "Q8_0", "Q4_0"):
        raise KtlongError(f"--kv-type {kv_type!r}: choose from BF16, FP16, FP32, Q8_0, Q4_0")
    kv_tier = kv_tier.strip().lower()
    if kv_tier not in ("ram", "disk"):
        raise KtlongError(f"--kv-tier {kv_tier!r}: choose ram or disk")
    names = [r.strip() for r in runtimes.split(",") if r.strip()]
    source = (f" --model {model}" if model else "") + (
        f" --shape {shape} --layers {layers} --weights {weights}" if shape else "")
    command = (f"ktlong bench e2e{source} --contexts {contexts} --new-tokens {new_tokens} "
               f"--runtimes {','.join(names)}{f' --repeats {repeats}' if repeats > 1 else ''}"
               f" --decode-runs {decode_runs}{f' --threads {threads}' if threads else ''}"
               f" --kv-type {kv_type} --kv-tier {kv_tier}")
    e2e.main(_lengths(contexts), new_tokens, threads, as_json, plot_file, names, repeats,
             command=command, decode_runs=decode_runs, model=model,
             gen=(shape, layers, weights) if shape else None, kv_type=kv_type, kv_tier=kv_tier)


@bench_app.command("serve")
def bench_serve(tokens: Annotated[str, typer.Option(
                    metavar="TOKENS", help="Document length, e.g. 32K.")] = "32K",
                model: ModelOpt = None, profile: ProfileOpt = None, sets: SetOpt = None,
                threads: ThreadsOpt = None, as_json: JsonOpt = False) -> None:
    """`ktlong serve` time to first token: a long system-message document's first request, a
    second question on it, and a restart (prompt cache); the demo model unless --model."""
    from ktlong.bench import serve as bench

    try:
        n = parse_int(tokens)
    except ValueError:
        raise KtlongError(f"--tokens {tokens!r}: expected a number like 32768 or 32K") from None
    from ktlong.demo import MODEL_DIR

    st = fitted(resolve(profile, sets, threads_num=threads), model or MODEL_DIR).settings
    if st.max_seq_len < n + 1024:  # the document, a question and the answer
        st = dataclasses.replace(st, max_seq_len=n + 4096)
    command = (f"ktlong bench serve --tokens {tokens}{f' --model {model}' if model else ''}"
               f"{f' --profile {profile}' if profile else ''}"
               f"{f' -t {threads}' if threads is not None else ''}")
    bench.main(n, st, model, as_json, command)


@bench_app.command("load")
def bench_load(model: ModelOpt = None,
               prompt_file: Annotated[list[str] | None, typer.Option(
                   "--prompt-file", "-f", metavar="FILE", show_default=False,
                   help="A client's document (repeat; the last is the one that leaves); "
                        "default: six license texts Debian ships, and GPL-2.")] = None,
               max_tokens: Annotated[int, typer.Option(
                   "--max-tokens", "-n", min=1, help="Tokens per answer.")] = 24,
               profile: ProfileOpt = None, sets: SetOpt = None, threads: ThreadsOpt = None,
               as_json: JsonOpt = False) -> None:
    """`ktlong serve` under load: every request alone, then all at once with a client that
    leaves after its first chunk; answers compared, /health polled, memory measured."""
    from ktlong.bench import load as bench

    if model is None:
        raise KtlongError("no model given", hint="pass --model, e.g. -m smollm2")
    st = fitted(resolve(profile, sets, threads_num=threads), model).settings
    command = (f"ktlong bench load -m {model} -n {max_tokens}"
               + "".join(f" -f {f}" for f in prompt_file or [])
               + (f" -t {threads}" if threads is not None else ""))
    bench.main(model, st, prompt_file or [], as_json, command, max_tokens)


@bench_app.command("faults")
def bench_faults(model: ModelOpt = None,
                 prompt_file: Annotated[str, typer.Option(
                     "--prompt-file", "-f", metavar="FILE",
                     help="The document.")] = "/usr/share/common-licenses/Apache-2.0",
                 points: Annotated[int, typer.Option(
                     min=1, help="Kills spread over the read (more at the write).")] = 8,
                 max_tokens: Annotated[int, typer.Option(
                     "--max-tokens", "-n", min=1, help="Tokens per answer.")] = 16,
                 threads: Annotated[int, typer.Option(
                     "--threads", "-t", min=1, help="Threads of every run.")] = 2,
                 as_json: JsonOpt = False) -> None:
    """`prefill` and `chat` killed (SIGKILL, SIGINT) while they read a document and write its
    cache entry; the next chat must give the uninterrupted answer and leave no temp file."""
    from ktlong.bench import faults

    if model is None:
        raise KtlongError("no model given", hint="pass --model, e.g. -m smollm2")
    command = (f"ktlong bench faults -m {model} -f {prompt_file} --points {points} "
               f"-n {max_tokens} -t {threads}")
    faults.main(str(model), prompt_file, points, max_tokens, threads, as_json, command)


@bench_app.command("qgemm")
def bench_qgemm(paths: Annotated[str | None, typer.Option(
                    help="Tile products, comma-separated: amx, avx512-vnni, avx-vnni, avx2 "
                         "(default: all this CPU has).")] = None,
                cpu: Annotated[str | None, typer.Option(
                    help="avx2 or avx-vnni: run as on a CPU without AVX-512 (AVX2 code on "
                         "this CPU).")] = None,
                threads: Annotated[str, typer.Option(
                    "--threads", "-t", help="Thread counts for the whole matrix.")] = "1,2",
                torch_too: Annotated[bool, typer.Option(
                    "--torch", help="Also torch float32 and QuantLinear (FP32, INT8).")]
                = False) -> None:
    """The int8 prefill GEMM per tile product (one tile, a 14336 x 4096 Q4_K matrix x 1,024
    tokens) in GOP/s, beside torch float32."""
    from ktlong.bench import qgemm
    from ktlong.kernels import qmatmul

    if cpu is not None and cpu not in qgemm.NARROW:
        raise KtlongError(f"--cpu {cpu}: not one of {', '.join(sorted(qgemm.NARROW))}")
    have = [p for p in qmatmul.GEMM_PATHS if qmatmul.HAVE_PATH[p]]
    for p in (paths or "").split(","):
        if p and p not in have:
            raise KtlongError(f"no {p} int8 GEMM on this CPU (it has: {', '.join(have)})",
                              hint="--cpu avx2 runs AVX2 code as a CPU without AVX-512 would")
    argv = ["--threads", threads] + (["--paths", paths] if paths else []) \
        + (["--cpu", cpu] if cpu else []) + (["--torch"] if torch_too else [])
    qgemm.main(argv)


@bench_app.command("eta")
def bench_eta(model: ModelOpt = None,
              prompt_file: Annotated[str, typer.Option(
                  "--prompt-file", "-f", metavar="FILE", help="The document.")] = "",
              profile: ProfileOpt = None, sets: SetOpt = None,
              threads: ThreadsOpt = None, as_json: JsonOpt = False) -> None:
    """How true the chat's ETA is: the chat reads the document (no cache) and every ETA its
    progress bar showed is held against the time really left (and a 30 s rate's ETA)."""
    from ktlong.bench import eta

    if model is None or not prompt_file:
        raise KtlongError("bench eta needs a model and a document",
                          hint="e.g. ktlong bench eta -m smollm2 -f book.txt -t 2")
    st = fitted(resolve(profile, sets, threads_num=threads), model).settings
    eta.main(model, prompt_file, st, as_json, " ".join(["ktlong", *sys.argv[1:]]))


@bench_app.command("hostile")
def bench_hostile(model: ModelOpt = None, as_json: JsonOpt = False) -> None:
    """Hostile documents (damaged, encrypted and bomb PDFs, EPUB/DOCX zip bombs and path tricks,
    a 50 MB line, bad encodings, binaries, link loops, a FIFO, a device) given to `ktlong chat`
    in a child each: what it said, exit code, peak RSS and time (the tiny test model unless -m)."""
    from ktlong.bench import hostile

    hostile.main(str(model) if model else "", as_json, " ".join(["ktlong", *sys.argv[1:]]))


@bench_app.command("cuda")
def bench_cuda(model: ModelOpt = None,
               lengths: Annotated[str, typer.Option(
                   help="With --model: prompt lengths for the speed rows (K suffix allowed).")]
               = "4K,32K",
               threads: ThreadsOpt = None, as_json: JsonOpt = False) -> None:
    """The GPU paths against the CPU on tiny random models (or --model on real prose): the same
    greedy tokens and logits for every way of reading; prefill tok/s, peak GPU memory and decode
    tok/s."""
    from ktlong.bench import cuda

    cuda.main(as_json, threads or 0, model, tuple(_lengths(lengths, "--lengths")))


@bench_app.command("agree")
def bench_agree(model: ModelOpt = None,
                docs: Annotated[str, typer.Option(
                    help="FILE:TOKENS items, comma-separated: each document cut to that many "
                         "tokens.")] = "/usr/share/common-licenses/MPL-2.0:1K,"
                "/usr/share/common-licenses/GPL-2:4K,/usr/share/common-licenses/GPL-3:7K",
                new_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens each.")] = 64,
                profile: ProfileOpt = None,
                threads: ThreadsOpt = 2,
                as_json: JsonOpt = False) -> None:
    """Greedy tokens of ktlong against llama.cpp on the same GGUF and the same prompt ids (needs
    the peers extra): where they first differ, and ktlong's logit margin there."""
    from ktlong import render
    from ktlong.bench import agree

    if model is None:
        raise KtlongError("no model given", hint="pass --model with a .gguf file or smollm2")
    items = []
    for item in docs.split(","):
        path, _, n = item.strip().rpartition(":")
        if not path or not Path(path).is_file():
            raise KtlongError(f"--docs: {item!r} is not FILE:TOKENS of an existing file",
                              hint="e.g. --docs /usr/share/common-licenses/GPL-3:7K")
        items.append((path, parse_int(n)))
    data = agree.run(str(model), items, new_tokens, profile or "dense", threads or 2)
    if as_json:
        render.print_json(data)
    else:
        agree.print_table(data)


@bench_app.command("plot")
def bench_plot(results: Annotated[list[Path], typer.Argument(
                   metavar="RESULT.json...", show_default=False,
                   help="What a `ktlong bench decode|e2e|accuracy|cache|prefill --json` printed; "
                        "several accuracy runs of one model and haystack are drawn as one.")],
               plot: Annotated[Path, typer.Option(
                   "--plot", metavar="FILE.png", show_default=False,
                   help="The PNG to write.")]) -> None:
    """Redraw a saved bench result as the bench's --plot would, without measuring again."""
    from ktlong.bench.plot import redraw

    redraw(results, plot)
    typer.echo(f"wrote {plot}", err=True)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app; errors raised outside a command get the same report."""
    try:
        app(args=argv, prog_name="ktlong")
    except BrokenPipeError:  # `ktlong ... | head`: the reader left; nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except Exception as e:  # the one top-level handler
        if _debug():
            raise
        sys.exit(_report(e))
