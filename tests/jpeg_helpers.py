"""JPEGs for the jpegxl tests, made by ``tools/gen_jpegs.py`` (natural photographs that
scikit-image and matplotlib ship, cropped, scaled and re-encoded by Pillow)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "gen_jpegs.py"


def gen_jpegs_module():
    """``tools/gen_jpegs.py`` as a module, or a skip when Pillow or every photograph is
    missing (the ``bench`` extra)."""
    pytest.importorskip("PIL", reason="Pillow (the bench extra) makes the test JPEGs")
    module = sys.modules.get("gen_jpegs")
    if module is None:
        spec = importlib.util.spec_from_file_location("gen_jpegs", TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules["gen_jpegs"] = module  # its pool's workers find their function by name
        spec.loader.exec_module(module)
    if not module.photo_paths():
        pytest.skip("no photographs: scikit-image or matplotlib (the bench extra) ships them")
    return module


def make_jpeg_tree(root: Path, files: int, seed: int = 7, cmyk: float = 0.0) -> dict[str, bytes]:
    """``files`` generated JPEGs under ``root``; returns relative path -> bytes."""
    gen_jpegs_module().generate(str(root), files, seed=seed, classes=4, cmyk=cmyk)
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*.jpg"))}


def jpeg_bytes(count: int, seed: int = 11, cmyk: float = 0.0) -> list[bytes]:
    """``count`` generated JPEGs in memory."""
    module = gen_jpegs_module()
    sources = module.load_sources(module.photo_paths())
    return [module.make_jpeg(i, seed, sources, cmyk) for i in range(count)]


def cmyk_jpeg() -> bytes:
    """A real JPEG libjxl cannot transcode (CMYK)."""
    return jpeg_bytes(1, seed=3, cmyk=1.0)[0]
