"""The ``kvbackend`` command: ``demo``, ``eval``, ``probe``, ``plan``, ``bpv``."""

from __future__ import annotations

import argparse
import sys

from kvbackend.errors import KVBackendError


def _int_at_least(least: int):
    """An argparse ``type`` taking integers >= ``least`` (a clear error for anything else)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {least}"
    return parse


def _cmd_bpv(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from kvbackend.tools.presets import DEFAULT_SPECS, measure

    table = Table(title=f"bits per value from stored bytes ({args.tokens}-token chunk, {args.heads} heads)")
    for col in ("spec", "D", "page bytes", "codebook bytes", "bpv", "K nrmse", "V nrmse"):
        table.add_column(col, justify="left" if col == "spec" else "right", overflow="fold")
    for dim in args.head_dim:
        for spec in args.codec or DEFAULT_SPECS:
            row = measure(spec, dim, args.tokens, args.heads)
            table.add_row(row.spec, str(dim), str(row.page_bytes), str(row.codebook_bytes),
                          f"{row.bits_per_value:.3f}", f"{row.k_nrmse:.4f}", f"{row.v_nrmse:.4f}")
    Console(width=max(Console().width, 120)).print(table)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvbackend.tools.demo import run_demo

    return run_demo(args)


def _cmd_probe(args: argparse.Namespace) -> int:
    from kvbackend.tools.probe import run_probe_cli

    return run_probe_cli(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from kvbackend.tools.plan import run_plan_cli

    return run_plan_cli(args)


def _cmd_eval(args: argparse.Namespace) -> int:
    from kvbackend.tools.evaluate import run_eval_cli

    return run_eval_cli(args)


def _device(text: str) -> str:
    """``--device``: a torch device this machine has, checked before any model loads."""
    from kvbackend.geometry import check_device

    try:
        check_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _model_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--model-dir``, shared by the commands that load the model."""
    parser.add_argument("--device", default="cpu", type=_device)
    parser.add_argument("--model-dir", default=None, help="directory holding a GGUF model (default: the shipped one)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvbackend", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bpv = sub.add_parser("bpv", help="measured bits per value of codec presets")
    bpv.add_argument("--codec", action="append", help="codec spec (repeatable); default: the presets")
    bpv.add_argument("--head-dim", type=_int_at_least(8), action="append", default=None)
    bpv.add_argument("--tokens", type=_int_at_least(1), default=2048, help="tokens in the encoded chunk")
    bpv.add_argument("--heads", type=_int_at_least(1), default=8)
    bpv.set_defaults(func=_cmd_bpv)

    demo = sub.add_parser("demo", help="the recommended spec and two reference points, serving the shipped model")
    demo.add_argument("--codec", action="append", help="codec spec (repeatable)")
    demo.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    demo.add_argument("--max-new-tokens", type=_int_at_least(1), default=24)
    demo.add_argument("--chunk-pages", type=_int_at_least(1), default=32,
                      help="64-token pages per chunk (default 32: 2048 tokens, as measured)")
    _model_options(demo)
    demo.set_defaults(func=_cmd_demo)

    ev = sub.add_parser("eval", help="measure codecs on a real model's KV for a text")
    ev.add_argument("--text", required=True, help="path of a UTF-8 text file")
    ev.add_argument("--codec", action="append", required=True, help="codec spec (repeatable)")
    ev.add_argument("--tokens", type=_int_at_least(1), default=2048, help="tokens of the attention-fidelity pass")
    ev.add_argument("--prefix", type=_int_at_least(1), default=1536, help="tokens cached through the codec")
    ev.add_argument("--continue", dest="cont", type=_int_at_least(2), default=512,
                    help="tokens teacher-forced after the prefix (at least 2: the first has no scored target)")
    ev.add_argument("--skip", type=_int_at_least(0), default=0,
                    help="drop the text's first N tokens before anything else (the text then starts there): "
                         "--prefix 1536 --skip 4608 scores the same continuation as --prefix 6144, so the two "
                         "runs differ only in how much cached context precedes it")
    ev.add_argument("--chunk", type=_int_at_least(64), default=2048,
                    help="tokens per codec chunk, a multiple of the 64-token page (default 2048, as the cache); "
                         "--chunk 64 makes every page its own chunk, as the SGLang storage backend stores pages")
    ev.add_argument("--json", help="write the figures as JSON here (its folder is created before the run)")
    ev.add_argument("--plot", help="write a Pareto plot (PNG) here (its folder is created before the run)")
    ev.add_argument("--seeds", type=_int_at_least(1), default=1,
                    help="run codecs that draw k-means seeds (qvg, quantwm, auto: plans over them) with seeds "
                         "0..N-1 and report each and their mean, min and max (default 1: the spec as given)")
    ev.add_argument("--path", choices=("paged", "sim", "both"), default="paged",
                    help="paged: through a KVCache, as an engine serves (default); sim: the sequence-level "
                         "simulation; both: paged, with the simulation beside it as a cross-check")
    _model_options(ev)
    ev.add_argument("--calibration", default=None,
                    help="text whose KV fits the frozen parts of alignpred:...,fit=frozen (predictors) and klt: (key "
                         "axes); use another text than --text")
    ev.add_argument("--plan-text", default=None,
                    help="plan auto:... specs on this text's first --prefix tokens instead of --text's own prefix "
                         "(a plan made once for the model and served on other text)")
    ev.set_defaults(func=_cmd_eval)

    pr = sub.add_parser("probe", help="far-away recall: a passcode planted before a long text, asked at its end")
    pr.add_argument("--text", required=True, help="filler text (UTF-8 file) placed between the facts and the questions")
    pr.add_argument("--codec", action="append", required=True, help="codec spec (repeatable)")
    pr.add_argument("--prefix", type=_int_at_least(1), default=6144, help="tokens of filler text")
    pr.add_argument("--questions", type=_int_at_least(1), default=8, help="rows: each asks one person's passcode")
    pr.add_argument("--distractors", type=_int_at_least(0), default=0,
                    help="other people's passcodes planted beside each row's own (default 0: a probe the exact "
                         "cache passes; with more, SmolLM2-135M confuses people even with the exact cache)")
    pr.add_argument("--chunk-pages", type=_int_at_least(1), default=32, help="64-token pages per chunk")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--json", help="write the answers and scores as JSON here")
    pr.add_argument("--calibration", default=None,
                    help="klt:...,paged=true specs: plan their key widths on this text (another text than --text)")
    _model_options(pr)
    pr.set_defaults(func=_cmd_probe)

    pl = sub.add_parser("plan", help="per-layer page codecs of a klt:...,paged=true or auto:bpv=B spec, as JSON")
    pl.add_argument("--codec", action="append", required=True, help="spec to plan (repeatable)")
    pl.add_argument("--calibration", required=True, help="UTF-8 text the plan is made on (not the served text)")
    pl.add_argument("--prefix", type=_int_at_least(2), default=2048, help="tokens of the calibration text read")
    pl.add_argument("--out", required=True, help="the JSON file written (its folder is created)")
    _model_options(pl)
    pl.set_defaults(func=_cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "head_dim", "absent") is None:
        args.head_dim = [64, 128]
    try:
        return int(args.func(args) or 0)
    except (KVBackendError, ValueError, OSError) as exc:  # bad specs, budgets, texts: a message, no traceback
        print(f"kvbackend {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
