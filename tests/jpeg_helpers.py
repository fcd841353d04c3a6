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


#: A real JPEG XL stream (2,305 bytes) of a uniform grey 8192x8192 JPEG (786,762 bytes,
#: Pillow quality 90), made once by ``imagecodecs.jpegxl_encode_jpeg``: decoding it makes
#: libjxl allocate about 154 MB whatever output size it is given, so a store that records
#: a few KB for it must refuse it unread (the jpegxl codec's size bound).
GREY_8192 = Path(__file__).resolve().parent / "fixtures" / "jpegxl" / "grey-8192x8192.jxl"
#: A real JPEG XL stream (12,935 bytes) of a grey 64x64 JPEG with 4,000 APP5 markers of
#: 65,533 zero bytes after its SOI (262,148,379 bytes), made the same way: libjxl rebuilds
#: the markers (262,144,017 bytes declared) before it writes the file, ~258 MB whatever
#: output size it is given.
APP5_4000 = GREY_8192.with_name("app5-4000x64k.jxl")
#: A real JPEG XL stream (18,406 bytes) of a grey 64x64 JPEG with 3,200 3-byte COM
#: segments after its SOI, each followed by 65,535 zero bytes that are no marker
#: (209,728,378 bytes), made the same way: libjxl allocates the inter-marker data
#: (209,712,000 bytes declared in the jbrd box, after its Huffman codes and scans) before
#: it writes the file, ~200 MB whatever output size it is given.
INTER_3200 = GREY_8192.with_name("inter-3200x64k.jxl")
#: The 64x64 grey JPEG's stream (1,904 bytes) with its frame header edited by hand: a
#: custom frame size of 8192x8192 (``custom_size_or_origin``) and a TOC of 1,042 empty
#: sections; the SizeHeader still says 64x64 and the jbrd box is intact. libjxl allocates
#: for the frame (~131 MB) before it finds the sections empty: an open hole of the bound.
FRAME_8192 = GREY_8192.with_name("frame-8192-in-64x64.jxl")


def padded(stream: bytes, size: int) -> bytes:
    """A JPEG XL container ``stream`` followed by a ``free`` box up to ``size`` bytes (a
    box libjxl skips), so it can take the place of a longer stored chunk."""
    pad = size - len(stream)
    assert pad >= 8, f"{len(stream)} bytes do not fit in {size} with a box header"
    return stream + pad.to_bytes(4, "big") + b"free" + bytes(pad - 8)
