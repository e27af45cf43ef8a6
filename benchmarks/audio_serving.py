"""Time what a user of an audio or video VLM feels, wrapped against unwrapped, at real sizes
with random weights: the ASR path of Whisper large-v3 and distil-whisper large-v3 on a stream
of 50 clips (feature extraction, the encoder, greedy decoding by the eager decoder), the
Qwen2.5-Omni-7B thinker's prefill of an image and an audio clip (time to first token, p50 and
p90), and Qwen2.5-VL-7B's vision tower on a 2-minute video at 2 frames per second (448x448
frames) served in frame chunks under a token cap and unchunked.

On a GPU each call is waited for and timed with CUDA events (the ASR path by the host clock,
since it reads tokens back); ``--tiny`` runs the same code on the CPU with tiny configurations
and simulated graphs. Errors are against a float32 copy, next to bf16 eager's own. Writes one
JSON file, after each part.

    python benchmarks/audio_serving.py --json audio-serving.json
    python benchmarks/audio_serving.py --tiny --json /tmp/tiny.json
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import transformers

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.timing import timed_call
from layergraph.validation import relative_error

SAMPLE_RATE = 16000


@dataclass(frozen=True)
class Setting:
    """Where and at what size a run happens."""

    tiny: bool
    device: torch.device
    dtype: torch.dtype

    def wrap(self, model: torch.nn.Module, **options: Any) -> Any:
        if self.tiny:
            options.setdefault("backend", SimulatedGraphs())
        return layergraph.wrap(model, **options)

    def build(self, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        """``make()`` built on the device in the run's dtype, as ``from_pretrained`` builds."""
        default = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with self.device:
                torch.manual_seed(0)
                return make().eval()
        finally:
            torch.set_default_dtype(default)

    def time_ms(self, call: Callable[[], Any]) -> float:
        """One call of ``call``, waited for, in milliseconds."""
        return timed_call(call, device=self.device)[1]

    def peak_reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated() / 2**30


def percentile(values: list[float], share: float) -> float:
    return float(np.percentile(values, share * 100))


# --- the ASR path -----------------------------------------------------------------------------


def whisper(setting: Setting, decoder_layers: int) -> torch.nn.Module:
    if setting.tiny:
        sizes = dict(d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128)
        sizes |= dict(decoder_attention_heads=2, decoder_ffn_dim=128, num_mel_bins=128)
        vocab = 300
    else:
        sizes = dict(d_model=1280, encoder_layers=32, encoder_attention_heads=20)
        sizes |= dict(encoder_ffn_dim=5120, decoder_attention_heads=20, decoder_ffn_dim=5120)
        sizes |= dict(num_mel_bins=128)
        vocab = 51866
    config = transformers.WhisperConfig(
        **sizes,
        decoder_layers=decoder_layers,
        vocab_size=vocab,
        max_source_positions=1500,
        max_target_positions=448,
        pad_token_id=vocab - 3,
        bos_token_id=vocab - 3,
        eos_token_id=vocab - 3,
        decoder_start_token_id=vocab - 2,
    )
    return setting.build(lambda: transformers.WhisperForConditionalGeneration(config))


def asr(setting: Setting, decoder_layers: int, clips: int, tokens: int) -> dict[str, Any]:
    """``clips`` clips of 2 to 30 s, one at a time: features on the host, then ``generate``
    of exactly ``tokens`` tokens; unwrapped, then wrapped (after one warm-up clip each)."""
    model = whisper(setting, decoder_layers)
    extractor = transformers.WhisperFeatureExtractor(feature_size=128)
    rng = np.random.default_rng(0)
    waves = [
        rng.standard_normal(int(rng.uniform(2, 30) * SAMPLE_RATE)).astype(np.float32) * 0.1
        for _ in range(clips)
    ]
    settings = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)

    def transcribe(wave: np.ndarray) -> torch.Tensor:
        features = extractor(wave, sampling_rate=SAMPLE_RATE, return_tensors="pt")
        x = features.input_features.to(setting.device, setting.dtype)
        return model.generate(x, **settings).cpu()

    def stream() -> tuple[list[float], list[torch.Tensor]]:
        transcribe(waves[0])
        times, answers = [], []
        for wave in waves:
            start = time.perf_counter()
            answers.append(transcribe(wave))
            times.append((time.perf_counter() - start) * 1e3)
        return times, answers

    with torch.inference_mode():
        eager_times, eager_tokens = stream()
        graphed = setting.wrap(model)
        wrapped_times, wrapped_tokens = stream()
        stats = graphed.stats
        graphed.unwrap()
    same = sum(torch.equal(a, b) for a, b in zip(eager_tokens, wrapped_tokens, strict=True))
    return {
        "clips": clips,
        "tokens_per_clip": tokens,
        "eager_total_s": sum(eager_times) / 1e3,
        "wrapped_total_s": sum(wrapped_times) / 1e3,
        "eager_p50_ms": statistics.median(eager_times),
        "wrapped_p50_ms": statistics.median(wrapped_times),
        "speedup": sum(eager_times) / sum(wrapped_times),
        "same_tokens": same,
        "replays": stats.replays,
        "eager_calls": stats.eager_total,
    }


# --- the Omni thinker's prefill ---------------------------------------------------------------

VISION_START, VISION_END = 151652, 151653


def omni_thinker(setting: Setting) -> torch.nn.Module:
    if setting.tiny:
        config = transformers.Qwen2_5OmniThinkerConfig(
            audio_config=dict(
                d_model=32, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64,
                num_mel_bins=128, n_window=100, output_dim=32,
            ),
            vision_config=dict(
                depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                fullatt_block_indexes=[1], out_hidden_size=32,
            ),
            text_config=dict(
                hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1,
                rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3]),
            ),
        )  # fmt: skip
    else:
        config = transformers.Qwen2_5OmniThinkerConfig()  # Qwen2.5-Omni-7B's sizes
    config.vision_start_token_id, config.vision_end_token_id = VISION_START, VISION_END
    return setting.build(lambda: transformers.Qwen2_5OmniThinkerForConditionalGeneration(config))


def omni_request(
    model: torch.nn.Module, side: int, seconds: float, setting: Setting
) -> dict[str, Any]:
    """A prompt of text around one ``side``-pixel square image and one clip of ``seconds``,
    laid out as Qwen2.5-Omni's processor lays them out."""
    config, vision = model.config, model.config.vision_config
    grid = side // vision.patch_size
    grid -= grid % vision.spatial_merge_size
    patches = grid * grid
    row = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    frames = int(seconds * 100)
    audio_tokens = ((frames - 1) // 2 + 1 - 2) // 2 + 1
    text = torch.randint(0, 150000, (40,)).tolist()
    ids = (
        text[:10]
        + [config.audio_start_token_id] + [config.audio_token_index] * audio_tokens
        + [config.audio_end_token_id] + text[10:20]
        + [VISION_START] + [config.image_token_index] * (patches // 4) + [VISION_END]
        + text[20:]
    )  # fmt: skip
    device, dtype = setting.device, setting.dtype
    return {
        "input_ids": torch.tensor([ids], device=device),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long, device=device),
        "pixel_values": torch.randn(patches, row, device=device, dtype=dtype),
        "image_grid_thw": torch.tensor([[1, grid, grid]], device=device),
        "input_features": torch.randn(1, 128, frames, device=device, dtype=dtype),
        "feature_attention_mask": torch.ones(1, frames, dtype=torch.long, device=device),
    }


def omni_prefill(setting: Setting, requests: int) -> dict[str, Any]:
    """``requests`` prefills (one forward keeping the last position's logits), unwrapped, then
    wrapped twice (the first pass observes the traffic and captures; the second is steady)."""
    model = omni_thinker(setting)
    rng = random.Random(0)
    sides = (224, 336, 448) if setting.tiny else (448, 672, 896, 1120)
    seconds = (2.0, 3.5) if setting.tiny else (3.0, 7.5, 12.0, 20.0, 30.0)
    with torch.inference_mode():
        drawn = [
            omni_request(model, rng.choice(sides), rng.choice(seconds), setting)
            for _ in range(requests)
        ]

        def prefill(inputs: dict[str, Any]) -> Any:
            return model(**inputs, logits_to_keep=1).logits

        def stream() -> tuple[list[float], list[torch.Tensor]]:
            times = [setting.time_ms(lambda r=r: prefill(r)) for r in drawn]
            return times, [prefill(r).float() for r in drawn[:4]]

        prefill(drawn[0])
        eager, want = stream()
        graphed = setting.wrap(model)
        observed, _ = stream()
        steady, got = stream()
        stats = {path: tower.stats for path, tower in graphed.towers.items()}
        graphed.unwrap()
    return {
        "requests": requests,
        "eager_ttft_p50_ms": statistics.median(eager),
        "eager_ttft_p90_ms": percentile(eager, 0.9),
        "first_pass_p50_ms": statistics.median(observed),
        "wrapped_ttft_p50_ms": statistics.median(steady),
        "wrapped_ttft_p90_ms": percentile(steady, 0.9),
        "speedup_p50": statistics.median(eager) / statistics.median(steady),
        "logits_error": max(relative_error(a, b) for a, b in zip(got, want, strict=True)),
        "towers": {
            path: {"replays": s.replays, "eager": dict(s.eager_calls), "graphs": s.graphs}
            for path, s in stats.items()
        },
    }


# --- a long video under a token cap -----------------------------------------------------------


def qwen2_5_vl_tower(setting: Setting) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as modeling

    if setting.tiny:
        sizes = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2)
        sizes |= dict(fullatt_block_indexes=[1], out_hidden_size=32)
    else:
        sizes = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16)
        sizes |= dict(fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=3584)
    config = transformers.Qwen2_5_VLVisionConfig(**sizes, window_size=112)
    return setting.build(lambda: modeling.Qwen2_5_VisionTransformerPretrainedModel(config))


def long_video(setting: Setting, seconds: int, side: int, cap: int, iters: int) -> dict[str, Any]:
    """One video of ``seconds`` at 2 frames per second: eager, wrapped under ``max_tokens=cap``
    (frame chunks), and wrapped with a cap above the whole video (one graph)."""
    tower = qwen2_5_vl_tower(setting)
    reference = copy.deepcopy(tower).float()
    config = tower.config
    grid = side // config.patch_size
    frames = seconds * 2 // config.temporal_patch_size
    patches = frames * grid * grid
    row = config.in_channels * config.temporal_patch_size * config.patch_size**2
    pixels = torch.randn(patches, row, device=setting.device)
    grid_thw = torch.tensor([[frames, grid, grid]], device=setting.device)
    x = pixels.to(setting.dtype)

    def answer(output: Any) -> torch.Tensor:
        return output.pooler_output if hasattr(output, "pooler_output") else output

    rows: dict[str, Any] = {"patches": patches, "temporal_patches": frames, "cap": cap}
    with torch.inference_mode():
        want = answer(reference(pixels, grid_thw=grid_thw)).float()
        del reference
        setting.peak_reset()
        eager = answer(tower(x, grid_thw=grid_thw)).float()
        rows["eager_peak_gib"] = setting.peak_gib()
        rows["bf16_eager_error"] = relative_error(eager, want)
        for name, limit in (("chunked", cap), ("unchunked", patches)):
            setting.peak_reset()
            graphed = setting.wrap(tower, observe_calls=0, max_tokens=limit)
            got = answer(graphed(x, grid_thw=grid_thw)).float()
            rows[f"{name}_error"] = relative_error(got, want)
            rows[f"{name}_peak_gib"] = setting.peak_gib()
            call = partial(graphed, x, grid_thw=grid_thw)
            times = [setting.time_ms(call) for _ in range(iters)]
            rows[f"{name}_ms"] = statistics.median(times)
            rows[f"{name}_graphs"] = graphed.stats.graphs
            rows[f"{name}_eager_calls"] = graphed.stats.eager_total
            rows[f"{name}_largest_graph"] = max(key.batch for key in graphed.keys)
            graphed.unwrap()
            del graphed, call
        times = [setting.time_ms(lambda: tower(x, grid_thw=grid_thw)) for _ in range(iters)]
        rows["eager_ms"] = statistics.median(times)
    for name in ("eager", "chunked", "unchunked"):
        rows[f"{name}_patches_per_s"] = patches / rows[f"{name}_ms"] * 1e3
    rows["chunked_share_of_unchunked"] = rows["unchunked_ms"] / rows["chunked_ms"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--tiny", action="store_true", help="tiny models on the CPU")
    parser.add_argument("--only", nargs="*", help="the parts to run (all by default)")
    args = parser.parse_args()
    transformers.logging.set_verbosity_error()
    tiny = args.tiny
    setting = Setting(
        tiny,
        torch.device("cpu" if tiny else "cuda"),
        torch.float32 if tiny else torch.bfloat16,
    )
    results: dict[str, Any] = {
        "device": "cpu (tiny)" if tiny else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "layergraph": layergraph.__version__,
        "python": platform.python_version(),
    }
    clips, tokens = (6, 8) if tiny else (50, 32)
    video = (4, 56, 32, 2) if tiny else (120, 448, 16384, 5)  # seconds, side, cap, iters
    parts = {
        "whisper-large-v3-asr": lambda: asr(setting, 2 if tiny else 32, clips, tokens),
        "distil-whisper-large-v3-asr": lambda: asr(setting, 1 if tiny else 2, clips, tokens),
        "omni-thinker-prefill": lambda: omni_prefill(setting, 30),
        "qwen2.5-vl-7b-long-video": lambda: long_video(setting, *video),
    }
    for name, run in parts.items():
        if args.only and name not in args.only:
            continue
        results[name] = run()
        print(name, json.dumps(results[name], indent=1), flush=True)
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
