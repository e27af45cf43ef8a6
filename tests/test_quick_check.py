"""The quick check's table names tests that exist, and covers every part it says it covers."""

from __future__ import annotations

import re
from pathlib import Path

from quick_check import QUICK

TEST_FOLDERS = (
    Path(__file__).parent,
    Path(__file__).parent.parent / "examples/layergraph-dinov2/tests",
)

COVERED = {
    "the engine": "test_runner.py",
    "the batched lane": "test_policy.py",
    "the packed lane": "test_budgets.py",
    "a faithful CPU replay": "test_faithful_replay.py",
    "the plugins": "test_plugins.py",
    "the CLI": "test_cli.py",
    "the docs' code": "test_docs.py",
    "timm": "test_timm_adapter.py",
    "internvl": "test_internvl_adapter.py",
    "siglip and clip": "test_siglip_clip_adapters.py",
    "the other transformers towers": "test_tower_families.py",
    "qwen2_vl": "test_qwen2_vl_adapter.py",
    "glm": "test_glm4v_adapter.py",
    "pixtral": "test_pixtral_adapter.py",
    "siglip2": "test_siglip2_adapter.py",
    "open_clip": "test_open_clip_adapter.py",
    "sentence_transformers": "test_sentence_transformers_adapter.py",
    "sequential": "test_sequential.py",
    "a third-party plugin (DINOv2)": "test_dinov2.py",
    "the embedding service": "test_serving.py",
    "audio encoders": "test_audio_encoders.py",
    "waveform encoders": "test_waveform_encoders.py",
    "omni audio towers": "test_omni_audio.py",
    "several towers in one model": "test_multi_tower.py",
    "the family records": "test_family_records.py",
}


def test_every_quick_test_is_defined_in_its_file() -> None:
    missing = []
    for file, names in QUICK.items():
        (path,) = [folder / file for folder in TEST_FOLDERS if (folder / file).is_file()]
        text = path.read_text()
        defined = set(re.findall(r"^def (test_\w+)\(", text, re.M))
        missing += [f"{file}::{name}" for name in names if name.split("[")[0] not in defined]
    assert missing == []


def test_the_quick_check_covers_each_part() -> None:
    assert {part: file for part, file in COVERED.items() if not QUICK.get(file)} == {}
