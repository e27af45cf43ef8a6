"""Time the audio towers served per token budget or per padded length, at their real sizes
with random weights, against eager: Qwen2.5-Omni-7B's and Qwen3-Omni's audio towers on one clip
of 10 s and of 30 s and on a stream of mixed lengths, and wav2vec 2.0 large on clips of
2 to 20 s (padded to half seconds, exact lengths, eager, and a hand-written CUDA graph of each
exact length).

Each call is timed with CUDA events and waited for (latency, the median of ``--iters``); errors
are against a float32 copy of the tower, next to bf16 eager's own. Writes one JSON file.

    python benchmarks/audio_towers.py --json audio-towers.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import transformers

import layergraph
from layergraph.reference import plain_graph
from layergraph.timing import waited_ms
from layergraph.validation import relative_error

MEL_BINS = 128
FRAMES_PER_SECOND = 100


def median_ms(call: Callable[[], Any], iters: int) -> float:
    """The median time of ``call`` in milliseconds, each call waited for."""
    return waited_ms(call, device=torch.device("cuda"), warmup=3, iters=iters)


def omni_tower(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen2.5-omni-7b":
        from transformers.models.qwen2_5_omni import modeling_qwen2_5_omni as modeling

        config = transformers.Qwen2_5OmniAudioEncoderConfig(output_dim=3584)
        return modeling.Qwen2_5OmniAudioEncoder(config).eval()
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as modeling

    config = transformers.Qwen3OmniMoeAudioEncoderConfig()
    return modeling.Qwen3OmniMoeAudioEncoder(config).eval()


def omni(kind: str, iters: int) -> dict[str, Any]:
    reference = omni_tower(kind).cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    calls = {
        "10 s": [10.0],
        "30 s": [30.0],
        "stream": [3.2, 7.5, 12.0, 1.1, 25.0, 4.4],
    }
    inputs = {}
    for name, seconds in calls.items():
        frames = [int(s * FRAMES_PER_SECOND) for s in seconds]
        features = torch.randn(MEL_BINS, sum(frames), device="cuda")
        inputs[name] = (features, torch.tensor(frames, device="cuda"))
    rows: dict[str, Any] = {}
    with torch.inference_mode():
        eager = {}
        for name, (features, lens) in inputs.items():
            half = features.bfloat16()
            eager[name] = median_ms(lambda f=half, n=lens: model(f, feature_lens=n), iters)
        want = {
            n: reference(f, feature_lens=lens).last_hidden_state for n, (f, lens) in inputs.items()
        }
        bf16_eager = {
            n: model(f.bfloat16(), feature_lens=lens).last_hidden_state
            for n, (f, lens) in inputs.items()
        }
        graphed = layergraph.wrap(model, observe_calls=0)
        for name, (features, lens) in inputs.items():
            x = features.bfloat16()
            graphed(x, feature_lens=lens)  # captures its budget
            got = graphed(x, feature_lens=lens).last_hidden_state
            rows[name] = {
                "eager_ms": eager[name],
                "layergraph_ms": median_ms(lambda f=x, n=lens: graphed(f, feature_lens=n), iters),
                "error": relative_error(got.float(), want[name]),
                "bf16_eager_error": relative_error(bf16_eager[name].float(), want[name]),
            }
            rows[name]["speedup"] = rows[name]["eager_ms"] / rows[name]["layergraph_ms"]
        rows["stats"] = {"budgets": list(graphed.stats.budgets), "eager": graphed.stats.eager_total}
        graphed.unwrap()
    return rows


def wav2vec2(iters: int) -> dict[str, Any]:
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=1024,
        num_hidden_layers=24,
        num_attention_heads=16,
        intermediate_size=4096,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
        conv_bias=True,
    )
    reference = transformers.Wav2Vec2Model(config).eval().cuda()
    model = copy.deepcopy(reference).to(torch.bfloat16)
    rows: dict[str, Any] = {}
    clips = {f"{s} s": torch.randn(1, int(s * 16000), device="cuda") for s in (2.3, 5.1, 9.7, 19.9)}
    with torch.inference_mode():
        for name, x in clips.items():
            xb = x.bfloat16()
            want = reference(x).last_hidden_state
            row = {"eager_ms": median_ms(lambda f=xb: model(f), iters)}
            row["bf16_eager_error"] = relative_error(model(xb).last_hidden_state.float(), want)
            row["hand_written_ms"] = median_ms(partial(plain_graph(model, xb), xb), iters)
            for mode, step in (("padded", 8000), ("exact", None)):
                graphed = layergraph.wrap(model, length_step=step)
                graphed(xb)
                got = graphed(xb).last_hidden_state
                row[f"{mode}_ms"] = median_ms(lambda g=graphed, f=xb: g(f), iters)
                row[f"{mode}_error"] = relative_error(got.float(), want)
                row[f"{mode}_eager_calls"] = graphed.stats.eager_total
                graphed.unwrap()
            rows[name] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--only", nargs="*", help="the parts to run (all by default)")
    args = parser.parse_args()
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "layergraph": layergraph.__version__,
        "python": platform.python_version(),
        "timing": "CUDA events, each call waited for, median of --iters; bf16, random weights",
    }
    parts = {
        "qwen2.5-omni-7b": lambda: omni("qwen2.5-omni-7b", args.iters),
        "qwen3-omni": lambda: omni("qwen3-omni", args.iters),
        "wav2vec2-large": lambda: wav2vec2(args.iters),
    }
    for name, run in parts.items():
        if args.only and name not in args.only:
            continue
        results[name] = run()
        print(name, json.dumps(results[name], indent=1), flush=True)
        with open(args.json, "w") as handle:  # after each part: a run cut short keeps them
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
