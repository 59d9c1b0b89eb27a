"""rl.prepare's byte-part joining, with small fake packages laid out like the real ones."""

from rl.prepare import MODELS, locate_gguf


def test_gemma3_parts_join_in_package_order(tmp_path, monkeypatch):
    # The real packages hold data/gemma-3-270m-q4_k_m.gguf.partNN (not data/partNN.bin), 60 MB each.
    site = tmp_path / "site"
    parts = []
    for i, pkg in enumerate(MODELS["gemma3-270m"][0]):
        data = site / pkg / "data"
        data.mkdir(parents=True)
        (site / pkg / "__init__.py").write_text("")
        parts.append(bytes([i]) * (5 + i))
        (data / f"gemma-3-270m-q4_k_m.gguf.part{i:02d}").write_bytes(parts[-1])
    monkeypatch.syspath_prepend(str(site))
    joined = locate_gguf("gemma3-270m", tmp_path)
    assert joined.read_bytes() == b"".join(parts)
