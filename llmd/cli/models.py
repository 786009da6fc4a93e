"""Model commands: `llmd models list|show|add|rm|pair|import|pull`, and use, pull, quantize, eval."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from llmd.cli._common import AddCommand, address_flags, client_of, mib, print_json, settings_of


def cmd_list(args: argparse.Namespace) -> int:
    models = client_of(args).models()
    if args.json:
        return print_json(models)
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "arch", "params", "quant", "size", "context", "loaded", "source")
    for m in models:
        mark = "active" if m["active"] else ("yes" if m["loaded"] else "")
        table.add_row(m["name"], m["arch"], f"{m['n_params'] / 1e6:.0f}M", m["quantization"], mib(m["size"]),
                      str(m["context_length"]), mark, m["source"])
    Console().print(table)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    m = client_of(args).model(args.name)
    if args.json:
        return print_json(m)
    if m["format"] == "remote":
        spec = json.loads(m["remote"])
        key = spec["api_key_env"] and f"key from ${spec['api_key_env']}" or spec["api_key_file"] and \
            f"key from {spec['api_key_file']}" or "no API key"
        print(f"{m['name']}: remote ({spec['kind']}), upstream model {spec['upstream_model']}, {key}"
              + (f", fallback {spec['fallback']}" if spec["fallback"] else ""))
        for url in spec["urls"]:
            print(f"  upstream: {url}")
        return 0
    est = m["memory_estimate"]
    print(f"{m['name']}: {m['arch']}, {m['n_params'] / 1e6:.0f}M parameters, {m['quantization']} ({m['format']}), "
          f"context {m['context_length']}, chat template: {'yes' if m['has_chat_template'] else 'no'}")
    print(f"  {'file' if m['format'] == 'gguf' else 'folder'}: {m['path']} ({mib(m['size'])}, {m['digest']})")
    if m.get("hf_path") and m["format"] == "gguf":
        print(f"  also a checkpoint for TensorRT-LLM: {m['hf_path']}")
    if est:
        print(f"  memory to load: {mib(est['total'])} = weights {mib(est['weights'])} + KV cache "
              f"{mib(est['kv'])} ({est['n_slots']} slots x {est['n_ctx']} tokens) + compute {mib(est['compute'])}")
    if m.get("fill_in_the_middle"):
        print("  fills in the middle (code completion: /infill, and `suffix` on /api/generate and /v1/completions)")
    if m.get("draft"):
        print(f"  draft model for speculation: {m['draft']}")
    if m.get("parent"):
        print(f"  quantized from {m['parent']} to {m['quant_type']}")
    if m.get("eval"):
        e = json.loads(m["eval"])
        line = f"  eval: perplexity {e['perplexity']:.3f} ({e['tokens_scored']} tokens, {e['text']} text)"
        if e.get("base"):
            line += (f"; vs {e['base']}: KL {e['kl_mean']:.5f}, top-1 {e['top1_agreement']:.1%}, "
                     f"ppl ratio {e['ppl_ratio']:.4f}")
        print(line)
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    if args.remote:
        if args.path or not args.as_name:
            print("llmd: a remote model is `llmd models add --remote URL [--remote URL2] --name NAME`", file=sys.stderr)
            return 2
        m = client_of(args).add_remote({
            "name": args.as_name, "urls": args.remote, "upstream_model": args.upstream_model,
            "api_key_env": args.api_key_env, "api_key_file": args.api_key_file and os.path.abspath(args.api_key_file),
            "fallback": args.fallback, "insecure": args.insecure})
        spec = json.loads(m["remote"])
        print(f"added {m['name']}: {spec['upstream_model']} on {', '.join(spec['urls'])} ({spec['kind']})"
              + (f", falling back to {spec['fallback']}" if spec["fallback"] else ""))
        return 0
    if not args.path:
        print("llmd: give a .gguf file or model folder to add (or --remote URL)", file=sys.stderr)
        return 2
    m = client_of(args).add_model(os.path.abspath(args.path), args.as_name)
    print(f"added {m['name']}: {m['arch']}, {m['quantization']}, {mib(m['size'])}")
    return 0


def cmd_pair(args: argparse.Namespace) -> int:
    if sum((bool(args.draft), args.none, args.auto)) != 1:
        print("llmd: `llmd models pair TARGET` needs one of DRAFT, --none or --auto", file=sys.stderr)
        return 2
    r = client_of(args).pair(args.name, args.draft, auto=args.auto)
    what = (f"{r['draft']} drafts for {r['model']}" if r["draft"] else
            f"{r['model']} gets a draft model automatically when a registered one fits" if r.get("auto") else
            f"{r['model']} has no draft model")
    print(what + ("; it reloads with the next request" if r["reloads"] else ""))
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    r = client_of(args).remove_model(args.name)
    print(f"removed {r['removed']}" + (" and deleted the file llmd had made" if r["deleted_file"] else
                                        " (its file was left in place)"))
    return 0


def cmd_use(args: argparse.Namespace) -> int:
    r = client_of(args).use(args.name)
    print(f"active model: {r['active_model']} (worker pid {r['pid']}, {r['switch_s']:.2f}s)")
    return 0


def _local_registry(args: argparse.Namespace) -> Any:
    from llmd.models.registry import Registry

    settings = settings_of(args)
    settings.paths.ensure()
    registry = Registry(settings.paths.registry_db, settings.paths.models_dir)
    registry.sync_packaged()
    return settings, registry


def cmd_quantize(args: argparse.Namespace) -> int:
    """Runs here (it is file work); the daemon sees the new model in the shared registry."""
    from pathlib import Path

    from rich.progress import BarColumn, Progress, TimeElapsedColumn

    from llmd.models.quantize import plan, quantize

    if args.backend == "tensorrt":
        from llmd.backends.tensorrt.engine import CALIB_FILE

        print("TensorRT models are quantized when the engine is built, calibrated on the prompts in "
              f"{args.calib or CALIB_FILE}; start the daemon with LLMD_BACKEND=tensorrt on a GPU machine.")
        return 0
    if args.imatrix:
        print("llmd: --imatrix is not supported yet: llama-cpp-python cannot pass an importance matrix to "
              "llama_model_quantize; use llama.cpp's llama-quantize --imatrix and `llmd models add`", file=sys.stderr)
        return 1
    settings, registry = _local_registry(args)
    src = registry.get(args.model)
    qtype = args.type.upper()
    name = args.name or f"{args.model}-{qtype.lower()}"
    registry.check_free(name)
    # a file of its own in the models folder, whatever the name holds (check_free allows no ".." part)
    p = plan(Path(src["path"]), settings.paths.models_dir / (name.replace("/", "--").replace(":", "-") + ".gguf"),
             qtype)
    if p.warning:
        print(f"warning: {p.warning}", file=sys.stderr)
    with Progress("[progress.description]{task.description}", BarColumn(), "{task.percentage:>3.0f}%",
                  TimeElapsedColumn(), transient=True) as bar:
        task = bar.add_task(f"{args.model} -> {qtype}", total=1.0)
        out = quantize(p, progress=lambda f: bar.update(task, completed=f))
    row = registry.add(out, name, source="created", parent=args.model, quant_type=qtype)
    print(f"created {name}: {row['quantization']}, {mib(row['size'])} (from {args.model}, {mib(src['size'])})")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from llmd.models.evaluate import evaluate, load_text

    settings, registry = _local_registry(args)
    model = registry.get(args.model)
    base = registry.get(args.base) if args.base else None
    text = load_text(Path(args.text)) if args.text else None
    from llmd.backends.repack import RepackRecord, decide_for_files

    paths = [model["path"], *([base["path"]] if base else [])]
    repack = decide_for_files(settings.repack, RepackRecord(settings.paths.repack_record), paths, args.model)
    if not repack.repack:
        print(f"note: {repack.reason}", file=sys.stderr)
    result = evaluate(model["path"], base["path"] if base else None, text, tokens=args.tokens, window=args.window,
                      repack=repack.repack)
    out = {**result.as_dict(), "base": args.base, "text": args.text or "built-in"}
    registry.set_eval(args.model, out)
    if args.json:
        return print_json(out)
    print(f"{args.model}: perplexity {result.perplexity:.3f} over {result.tokens_scored} tokens "
          f"({result.windows} windows of {result.window})")
    if base is not None:
        assert result.kl_mean is not None and result.top1_agreement is not None and result.ppl_ratio is not None
        print(f"against {args.base}: mean KL divergence {result.kl_mean:.5f} (p99 {result.kl_p99:.4f}), "
              f"top-1 agreement {result.top1_agreement:.1%}, perplexity ratio {result.ppl_ratio:.4f}")
        kl_warn = args.kl_warn if args.kl_warn is not None else settings.kl_warn
        if result.kl_mean > kl_warn:
            print(f"warning: KL divergence {result.kl_mean:.4f} is above {kl_warn} (LLMD_KL_WARN / --kl-warn): "
                  "this quantization changes the model's answers noticeably")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """Find models other tools downloaded and register them in place (file work, done here; the
    daemon reads the same registry)."""
    from llmd.models.importers import find_all

    sources = ("ollama", "lmstudio", "hf") if args.source == "all" else (args.source,)
    found = find_all(sources)
    settings, registry = _local_registry(args)
    known = {r["path"]: r["name"] for r in registry.list()}
    results = []
    for f in found:
        status = f.skip and f"skipped: {f.skip}"
        if status is None and str(f.path.resolve()) in known:
            status = f"already registered as {known[str(f.path.resolve())]}"
        if status is None and registry.has(f.name):
            status = f"skipped: the name {f.name} is taken"
        if status is None and not args.dry_run:
            registry.add(f.path, f.name, source=f.source, **({"digest": f.digest} if f.digest else {}))
            status = "imported"
        results.append({**f.as_dict(), "status": status or "would import"})
    if args.json:
        return print_json(results)
    if not results:
        print("no models found in " + ", ".join(sources) + " stores")
    for r in results:
        print(f"{r['source']:<8} {r['name']:<40} {r['arch'] or '?':<10} {r['quantization'] or '?':<8} "
              f"{mib(r['size']):>9}  {r['status']}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    """Download a GGUF model from the Hugging Face Hub and register it (file work, done here; the
    daemon reads the same registry)."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from llmd.models.hub import HubFile, PullPlan, pull

    settings, registry = _local_registry(args)
    tasks: dict[str, Any] = {}
    shown: list[str] = []
    bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn(), disable=args.json)

    def planned(p: PullPlan) -> None:
        shown.extend(p.notes)
        for note in p.notes:
            print(f"note: {note}", file=sys.stderr)
        print(f"pulling {p.ref.repo} {p.quant} at {p.revision[:12]} as {p.name}: "
              f"{len(p.files)} file(s), {mib(p.size)}", file=sys.stderr)
        for f in p.files:
            tasks[f.name] = bar.add_task(f.name, total=f.size)

    def progress(f: HubFile, done: int) -> None:
        bar.update(tasks[f.name], completed=done)

    try:
        with bar:
            row = pull(args.ref, registry, settings.paths.models_dir, progress, args.as_name, planned)
    except KeyboardInterrupt:
        print("\ninterrupted: nothing was registered; the downloaded part is kept, run the same command to "
              "resume", file=sys.stderr)
        return 130
    for note in row["notes"][len(shown):]:  # what the pull itself found (an already pulled model)
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        return print_json(row)
    print(f"pulled {row['name']}: {row['arch']}, {row['quantization']}, {mib(row['size'])} ({row['path']})")
    return 0


def register(cmd: AddCommand) -> None:
    m = cmd("models", cmd_list, "list (the default), show, add, rm or pair models")
    m.add_argument("--json", action="store_true")
    actions = m.add_subparsers(dest="action", metavar="{list,show,add,rm,pair,import,pull}")

    def action(name: str, fn: Any, help: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help)
        address_flags(a, keep_parent=True)
        a.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
        a.set_defaults(fn=fn)
        return a

    action("list", cmd_list, "registered models")
    action("show", cmd_show, "one model: files, memory to load, draft, eval").add_argument("name")
    a = action("add", cmd_add, "register a .gguf file, a Hugging Face checkpoint, a TensorRT engine folder, or "
                               "(--remote) a model another engine serves")
    a.add_argument("path", nargs="?")
    a.add_argument("--name", dest="as_name", help="name to register it under")
    a.add_argument("--remote", action="append", metavar="URL",
                   help="an OpenAI-compatible upstream (vLLM, SGLang, trtllm-serve, llama-server, Ollama, llmd); "
                        "repeat for several")
    a.add_argument("--upstream-model", help="the model id the upstream serves (default: its only one)")
    a.add_argument("--api-key-env", help="environment variable holding the upstream's API key")
    a.add_argument("--api-key-file", help="file (mode 600) holding the upstream's API key")
    a.add_argument("--fallback", help="a local model that answers while every upstream is down")
    a.add_argument("--insecure", action="store_true", help="allow plain http to other machines")
    action("rm", cmd_rm, "remove a model (deletes only files llmd made)").add_argument("name")
    for parent, fn_help in ((action, "download a GGUF model from the Hugging Face Hub"), (cmd, "= llmd models pull")):
        a = parent("pull", cmd_pull, fn_help)
        a.add_argument("ref", metavar="REPO[:QUANT]", help="USER/REPO[:QUANT] (default Q4_K_M) or USER/REPO/FILE.gguf")
        a.add_argument("--name", dest="as_name", help="name to register it under (default REPO:QUANT)")
        if parent is cmd:
            a.add_argument("--json", action="store_true")
    a = action("import", cmd_import, "register models Ollama, LM Studio or the Hugging Face cache downloaded, "
                                     "in place (never moved or deleted)")
    a.add_argument("--from", dest="source", choices=["ollama", "lmstudio", "hf", "all"], default="all")
    a.add_argument("--dry-run", action="store_true", help="list what would be imported")
    a = action("pair", cmd_pair, "a smaller model with the same vocabulary drafts for TARGET")
    a.add_argument("name", metavar="TARGET")
    a.add_argument("draft", nargs="?", metavar="DRAFT")
    a.add_argument("--none", action="store_true", help="no draft model for TARGET, not even an automatic one")
    a.add_argument("--auto", action="store_true", help="let llmd pair a registered model that shares TARGET's "
                   "vocabulary at half its size or less (the default)")

    s = cmd("use", cmd_use, "switch the active model (loads it, retires the other)")
    s.add_argument("name")
    s = cmd("quantize", cmd_quantize, "quantize a registered model into a new one (llama.cpp types)")
    s.add_argument("model")
    s.add_argument("--type", required=True, help="Q4_K_M, Q4_0, Q5_K_M, Q8_0 or F16")
    s.add_argument("--name", help="name of the new model (default MODEL-TYPE)")
    s.add_argument("--imatrix", help="importance matrix file (not supported yet)")
    s.add_argument("--backend", choices=["llama.cpp", "tensorrt"], default="llama.cpp")
    s.add_argument("--calib", help="TensorRT calibration prompts file")
    s = cmd("eval", cmd_eval, "perplexity, and KL divergence / top-1 agreement against a base model")
    s.add_argument("model")
    s.add_argument("--base", help="reference model (e.g. the F16 original)")
    s.add_argument("--text", help="evaluation text file (default: the text shipped with llmd)")
    s.add_argument("--tokens", type=int, default=1024)
    s.add_argument("--window", type=int, default=256)
    s.add_argument("--kl-warn", type=float, default=None, help="default: LLMD_KL_WARN")
    s.add_argument("--json", action="store_true")
