"""The ``rollmatch`` command line (argument parsing; each command lives in its component).

Every command imports its implementation lazily so ``rollmatch --help`` and ``check-config`` stay
fast. Errors of the :mod:`rollmatch.errors` hierarchy print one clear message and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from rollmatch.errors import RollmatchError
from rollmatch.rollout.engine_logs import engine_log_level
from rollmatch.server.limits import add_server_limit_flags

# command name -> "module:function"; the function takes the parsed argparse.Namespace, returns an exit code.
COMMANDS: dict[str, str] = {
    "train": "rollmatch.training.entry:train_command",
    "check-config": "rollmatch.data.input_checks:check_config_command",
    "make-tiny-model": "rollmatch.models.tiny:make_tiny_model_command",
    "add-coord-tokens": "rollmatch.models.coord_vocab:add_coord_tokens_command",
    "data": "rollmatch.data.commands:data_command",
    "demo": "rollmatch.demo:demo_command",
    "eval": "rollmatch.evaluation:eval_command",
    "viz": "rollmatch.viz:viz_command",
    "diagnose": "rollmatch.diagnostics:diagnose_command",
    "serve": "rollmatch.server.serve:serve_command",
    "launch": "rollmatch.launch.command:launch_command",
    "export": "rollmatch.models.export:export_command",
    "preflight": "rollmatch.training.preflight:preflight_command",
}


DESCRIPTION = """\
rollmatch trains Qwen-VL vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) to detect objects
from their own rollouts: the model decodes boxes as JSON, the boxes are matched to the ground truth,
and the model learns from targets built from that match (rollout-matching SFT, Stage-2 AB).
"""

EPILOG = """\
where to start:
  rollmatch demo                                 tiny end-to-end run on CPU (minutes, no downloads)
  rollmatch data convert --format coco ...       your annotations -> JSONL records (docs/data.md)
  rollmatch check-config configs/recipes/qwen3_vl_4b_coco.yaml
  rollmatch preflight CONFIG.yaml                does the start model answer in the format? (before Stage-2)
                                                 a recipe for a real checkpoint (configs/recipes/)
  rollmatch launch CONFIG.yaml                   rollout servers + learner on one or more GPU nodes
  rollmatch eval --model DIR --data val.jsonl    P/R/F1 and COCO mAP of a checkpoint
Every command has --help; docs/runbook.md walks through a run.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollmatch",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for add_command in (
        _add_train_parser,
        _add_check_config_parser,
        _add_add_coord_tokens_parser,
        _add_make_tiny_model_parser,
        _add_data_parser,
        _add_demo_parser,
        _add_eval_parser,
        _add_diagnose_parser,
        _add_viz_parser,
        _add_serve_parser,
        _add_launch_parser,
        _add_export_parser,
        _add_preflight_parser,
    ):
        add_command(sub)
    for command in sub.choices.values():  # every command: the engine's INFO lines and repeats on demand
        command.add_argument(
            "--verbose",
            action="store_true",
            help="show the rollout engine's (vLLM) INFO lines and every repeated line (default: WARNING, "
            "each kind of line once, repeats counted)",
        )
    return parser


def _add_train_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("train", help="Train with a YAML config (run under torchrun for several ranks).")
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. training.max_steps=10")


def _add_check_config_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "check-config",
        help="Print the fully resolved config, or every problem in it and in its inputs (files, record lengths).",
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument("--json", action="store_true", help="print the resolved config as JSON")
    p.add_argument(
        "--schema-only",
        action="store_true",
        help="check keys and rules only, not the inputs (model directory, data files, DeepSpeed JSON, "
        "record lengths): e.g. on a machine without the data",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="resolve for N learner processes, as `train` under torchrun would (default: $WORLD_SIZE, else 1)",
    )


def _add_add_coord_tokens_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "add-coord-tokens",
        help="Add the 1,000 coordinate tokens of object_format coord_tokens to a checkpoint (docs/detection.md).",
    )
    p.add_argument("--model", required=True, help="model directory (HF format, with its processor)")
    p.add_argument("--out", required=True, help="output directory (may be --model itself)")


def _add_make_tiny_model_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("make-tiny-model", help="Build a random-initialised tiny Qwen-VL model offline.")
    p.add_argument("--family", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl"], default="qwen2_5_vl")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--text-hidden", type=int, default=128, help="LM width (a multiple of 64; heads = width/32)"
    )
    p.add_argument("--text-layers", type=int, default=2, help="LM decoder layers")
    p.add_argument("--text-intermediate", type=int, default=256, help="LM MLP width")
    p.add_argument("--vision-hidden", type=int, default=64, help="vision tower width (a multiple of 32)")
    p.add_argument("--vision-depth", type=int, default=2, help="vision tower blocks")
    p.add_argument(
        "--rope-theta",
        type=float,
        default=None,
        help="LM rope theta (default: the family's; 10 for tiny 2.5-VL)",
    )
    p.add_argument(
        "--coord-tokens",
        action="store_true",
        help="add the 1,000 coordinate tokens (custom.object_format: coord_tokens)",
    )


def _add_data_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("data", help="Datasets: synthetic shapes, converters to JSONL.")
    data_sub = p.add_subparsers(dest="data_command", required=True)
    d = data_sub.add_parser("shapes", help="Generate the synthetic coloured-shapes detection set.")
    d.add_argument("--out", required=True)
    d.add_argument("--train", type=int, default=256, help="number of training images")
    d.add_argument("--val", type=int, default=32, help="number of validation images")
    d.add_argument("--size", type=int, default=224, help="image side in pixels")
    d.add_argument("--seed", type=int, default=0)
    # Difficulty flags default to None: the preset's value (or the generator's default) applies.
    d.add_argument("--preset", choices=["crowd"], help="named difficulty (crowd: 8-30 objects of 16-32 px)")
    d.add_argument("--min-objects", type=int, help="fewest shapes per image (default 1)")
    d.add_argument("--max-objects", type=int, help="most shapes per image (default 6)")
    d.add_argument("--min-side", type=int, help="smallest shape side, px at 224, scaled (default 30)")
    d.add_argument("--max-side", type=int, help="largest shape side, px at 224, scaled (default 90)")
    d.add_argument("--noise", type=float, help="std of the pixel noise, 0: clean (default 12)")
    d.add_argument("--tied-rows", type=float, help="fraction of images whose 2nd shape shares the 1st's row")
    d.add_argument("--max-overlap", type=float, help="max box intersection / smaller box area (default 0.2)")
    d.add_argument(
        "--occlusion",
        type=float,
        help="later shapes cover earlier ones; drop a shape hidden beyond this fraction (default: no cover)",
    )
    d.add_argument(
        "--same-class-rows", type=float, help="fraction of images with a row of 4-8 same-class shapes"
    )
    d.add_argument("--distractors", type=int, help="unlabelled shapes outside the label set per image")
    d.add_argument("--count-dist", choices=["uniform", "zipf"], help="object count distribution")
    d = data_sub.add_parser(
        "convert", help="Convert COCO / LVIS json, Pascal VOC xml, YOLO txt, RefCOCO-style refs to JSONL."
    )
    d.add_argument("--format", choices=["coco", "lvis", "voc", "yolo", "refexp"], required=True)
    d.add_argument(
        "--src",
        required=True,
        help="annotation file (coco, lvis; refexp: refs .json/.parquet) or folder (voc, yolo)",
    )
    d.add_argument("--images", help="image folder (coco, lvis, refexp: where the images are)")
    d.add_argument("--names", help="yolo: data.yaml with class names")
    d.add_argument("--instances", help="refexp: the COCO instances.json shipped with the refs")
    d.add_argument("--split", help="refexp: keep refs of this split only (train, val, testA, ...)")
    d.add_argument("--out", required=True, help="output JSONL")
    d = data_sub.add_parser("validate", help="Check a JSONL file; report every bad record.")
    d.add_argument("file")


def _add_demo_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="Tiny end-to-end run on CPU: stage-1 SFT, then rollout-matching SFT.")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides of the demo config")


def _add_eval_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "eval", help="Roll out over a dataset; precision/recall/F1 at matching.iou_threshold and COCO mAP."
    )
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSONL records")
    p.add_argument("--out", help="predictions JSONL (default: <model>/predictions.jsonl)")
    p.add_argument(
        "--config",
        help="YAML config (data, decoding, matching, engine); without it the engine settings are picked "
        "for this machine and printed",
    )
    p.add_argument("--backend", choices=["hf", "vllm"], default=None)
    p.add_argument(
        "--max-samples", type=int, default=None, help="evaluate the first N records (eval.max_samples)"
    )
    p.add_argument(
        "--pictures",
        type=_non_negative_int,
        default=0,
        help="draw the first N images into <predictions dir>/pictures",
    )
    p.add_argument(
        "--coco-results",
        help="also write the standard COCO results JSON here (image_id, category_id, bbox [x, y, w, h] in "
        "original pixels, score by list position); needs --coco-annotations",
    )
    p.add_argument(
        "--coco-annotations",
        help="the COCO annotation json the --data records were converted from (its image and category ids)",
    )
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")


def _add_diagnose_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "diagnose",
        help="Without training: how each rollout-matching target differs from SFT's (token ids) and how "
        "much recall drops after the model's own prefix vs the GT's (exposure bias); JSON.",
    )
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True, help="JSONL records (a dev split)")
    p.add_argument("--config", help="YAML config (data, matching, engine); without it as in `rollmatch eval`")
    p.add_argument("--backend", choices=["hf", "vllm"], default=None)
    p.add_argument("--max-samples", type=_positive_int, default=None, help="the first N records")
    p.add_argument(
        "--prefix-k",
        type=_positive_int,
        nargs="+",
        default=[1, 2],
        help="prefix lengths (objects) of the prefix-sensitivity probe",
    )
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")


def _add_viz_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("viz", help="Draw GT and predicted boxes per image, plus a grid PNG.")
    p.add_argument("--data", required=True, help="JSONL records the predictions were made on")
    p.add_argument("--predictions", required=True, help="predictions JSONL written by `rollmatch eval`")
    p.add_argument("--out", required=True, help="output folder for <id>.png and grid.png")
    p.add_argument("--grid", type=_positive_int, default=16, help="images in grid.png")
    p.add_argument("--max-images", type=_positive_int, default=None, help="draw only the first N images")
    p.add_argument(
        "--iou-threshold",
        type=_unit_interval,
        default=0.5,
        help="eval.matching.iou_threshold the predictions were scored with",
    )
    p.add_argument(
        "--label-mode",
        choices=["ignore", "require"],
        default="require",
        help="eval.matching.label_mode the predictions were scored with",
    )


def _add_serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="Run a rollout server (swift-compatible HTTP API + weight sync).")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--data-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enable-lora", action="store_true", help="vLLM engine: accept adapter weight syncs")
    p.add_argument(
        "--max-num-seqs", type=int, default=None, help="vLLM engine: sequences per batch (default: vLLM's)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM engine: fraction of GPU memory (vllm.gpu_memory_utilization; default 0.9)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM engine: reuse the KV cache of shared prompt prefixes (vllm.enable_prefix_caching; default on)",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="vLLM engine: no CUDA graphs / compilation (vllm.enforce_eager; always on CPU)",
    )
    p.add_argument(
        "--kv-cache-space-gib",
        type=float,
        default=None,
        help="vLLM engine on CPU: KV cache size in GiB (vllm.kv_cache_space_gib; default 1)",
    )
    p.add_argument(
        "--min-pixels", type=int, default=None, help="image processor min_pixels (data.min_pixels)"
    )
    p.add_argument(
        "--max-pixels", type=int, default=None, help="image processor max_pixels (data.max_pixels)"
    )
    p.add_argument(
        "--coord-frame",
        choices=["auto", "norm1000", "pixels"],
        default="auto",
        help="box frame the trainer serializes in (data.coord_frame; auto: the model family's), "
        "reported by GET /info/ and checked by the trainer at start-up",
    )
    # Security and limits (docs/server.md, "Security model"); the limits are ServerLimits' fields.
    # Access (rollmatch.server.gate): a --host that is not loopback needs a key or --insecure-no-auth.
    key = p.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        default=None,
        help="token every call but GET /health/ needs (default: $ROLLMATCH_API_KEY)",
    )
    key.add_argument(
        "--api-key-file", default=None, help="read the token from this file (kept out of the process list)"
    )
    sync_key = p.add_mutually_exclusive_group()
    sync_key.add_argument(
        "--sync-key",
        default=None,
        help="key /init_communicator/ needs (X-Rollmatch-Sync-Key), apart from the API key, so API-key "
        "holders can generate but not replace the weights (default: $ROLLMATCH_SYNC_KEY; none: the API key suffices)",
    )
    sync_key.add_argument(
        "--sync-key-file",
        default=None,
        help="read the sync key from this file (kept out of the process list)",
    )
    p.add_argument(
        "--insecure-no-auth", action="store_true", help="allow a non-loopback --host without a key"
    )
    p.add_argument("--allowed-local-media-path", default=None, help="directory images may be read from")
    add_server_limit_flags(p)


def _add_export_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export", help="A checkpoint as a standalone model folder: merged weights, processor, model card."
    )
    p.add_argument("--checkpoint", required=True, help="checkpoint-N or final/ folder of a run")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--processor", help="where the tokenizer/processor is, when the checkpoint has none")


def _add_preflight_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "preflight",
        help="Roll out training records with the start model: is it ready for rollout training? "
        "(exit 1 when the valid fraction is below preflight.min_valid_fraction)",
    )
    p.add_argument("config", help="YAML config (the one `train` takes)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    p.add_argument(
        "--records", type=_positive_int, default=None, help="records to roll out (default: preflight.records)"
    )


def _add_launch_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "launch",
        help="Start rollout servers and the torchrun learner on disjoint devices; stop them all on exit.",
        description="GPUs: --server-devices 0,1,2,3,4,5 --learner-devices 6,7 [--tensor-parallel-size 2] "
        "(or the config's launch: section); CPU: --cpu --servers 1 --learner-procs 2; several nodes: "
        "launch.nodes.* (docs/runbook.md). Overrides go right after the config; a flag named with a launch.* "
        "key sets that key (applied after the overrides, checked by the config's rules).",
    )
    p.add_argument("config", help="YAML config (the one `train` takes) with vllm.mode: server")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. training.max_steps=10")
    p.add_argument(
        "--server-devices",
        default="",
        help="GPUs of the rollout servers, e.g. 0,1,2,3 (launch.server_devices)",
    )
    p.add_argument(
        "--learner-devices",
        default="",
        help="GPUs of the learner, one torchrun rank each (launch.learner_devices)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=None,
        help="GPUs per server (default: launch.tensor_parallel_size, 1); servers = server devices / this",
    )
    p.add_argument("--cpu", action="store_true", help="run every process on the CPU (gloo learner)")
    p.add_argument("--servers", type=_positive_int, default=None, help="--cpu: rollout servers (default 1)")
    p.add_argument(
        "--learner-procs", type=_positive_int, default=None, help="--cpu: learner ranks (default 1)"
    )
    only = p.add_mutually_exclusive_group()
    only.add_argument("--servers-only", action="store_true", help="start and keep only the servers")
    only.add_argument(
        "--learner-only", action="store_true", help="start only the learner (config names servers)"
    )
    p.add_argument(
        "--engine", choices=["vllm", "hf"], default=None, help="rollout server engine (launch.engine, vllm)"
    )
    p.add_argument(
        "--port-base",
        type=int,
        default=None,
        help="fixed ports from here (launch.port_base; default: free ports)",
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=None,
        help="seconds between SIGTERM and SIGKILL at teardown (launch.grace_s, 10)",
    )
    p.add_argument(
        "--dry-run", action="store_true", help="print every node's commands and environment; start nothing"
    )
    p.add_argument(
        "--emit",
        choices=["slurm"],
        default=None,
        help="print an sbatch script that runs this launch on launch.nodes.count nodes; start nothing",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a non-negative integer")
    return value


def _unit_interval(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value


def _resolve(target: str) -> Callable[[argparse.Namespace], int]:
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine_log_level(verbose=args.verbose)  # before any engine is imported, inherited by child processes
    try:
        return int(_resolve(COMMANDS[args.command])(args) or 0)
    except RollmatchError as exc:
        print(f"rollmatch {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] == ["launch"]:  # done with its teardown: skip the interpreter's (launch.command)
        from rollmatch.launch.command import exit_launcher

        exit_launcher(code)
    sys.exit(code)
