"""Codec plug-ins for tests: a real installed distribution (dist-info + entry points), and one over zlib."""

from __future__ import annotations

import textwrap
from pathlib import Path


def dist(tmp_path: Path, name: str, entry_points: str, modules: dict[str, str] | None = None):
    """A real installed distribution: a dist-info with METADATA and entry_points.txt (and its modules) in ``tmp_path``."""
    info = tmp_path / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[gangd.codecs]\n{entry_points}\n")
    for module, source in (modules or {}).items():
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))


ZLIB_PLUGIN = '''
    """A plug-in codec over the standard library's zlib, as an accelerator's package would ship one."""
    import zlib


    class ZlibCodec:
        name = "zlibtest"
        version = 2

        def __init__(self, level):
            self.level = level

        def compress(self, data, itemsize):
            return zlib.compress(data, self.level)

        def decompress_into(self, data, out):
            d = zlib.decompressobj()
            raw = d.decompress(data, len(out) + 1)  # bounded: at most one byte more than the block holds
            if len(raw) != len(out) or not d.eof:
                raise ValueError(f"{len(raw)} bytes, expected {len(out)}")
            out[:] = raw
            return len(out)


    def make(params):
        (level,) = params or ("6",)
        if not level.isdigit() or not 0 <= int(level) <= 9:
            raise ValueError("the level is 0..9")
        return ZlibCodec(int(level))


    def wrong_name(params):
        codec = ZlibCodec(1)
        codec.name = "zstd"
        return codec
'''
