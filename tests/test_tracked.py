import numpy as np
import pytest

from mfpipe.corpus.tracked import TrackedSet, count_types, select_tracked


def test_top_n_excludes_bos_and_breaks_ties_by_id():
    windows = np.array([[0, 3, 3, 5, 5, 7, 0], [0, 3, 9, 5, 2, 2, 1]])  # id 0 is BOS, also at a late position
    counts = count_types([windows], vocab_size=10)
    assert counts[0] == 1 and counts[3] == 3 and counts[5] == 3  # position 0 never counted
    ts = select_tracked(counts, 3, bos_id=0, decode=lambda i: f"t{i}")
    assert ts.type_ids.tolist() == [3, 5, 2]  # 3 and 5 tie at 3 (smaller id first), then 2
    assert 0 not in ts.type_ids
    assert ts.coverage == pytest.approx(8 / 12)
    all_ts = select_tracked(counts, 100, bos_id=0, decode=str)
    assert 0 not in all_ts.type_ids and len(all_ts.type_ids) == 6  # only types that occur


def test_bucket_luts_and_roundtrip(tmp_path):
    ts = TrackedSet(type_ids=[7, 2, 4], strings=["a", "b", "c"], counts=[9, 5, 1], bos_id=0, vocab_size=10, total_positions=20)
    k = ts.key_bucket_lut()
    assert k[7] == 0 and k[2] == 1 and k[4] == 2 and k[5] == ts.other_bucket == 4
    q = ts.query_bucket_lut()
    assert q[5] == -1 and q[4] == 2
    assert ts.key_labels() == ["a", "b", "c", "<bos>", "<other>"]
    ts.save(tmp_path / "t.json")
    back = TrackedSet.load(tmp_path / "t.json")
    assert back.fingerprint == ts.fingerprint and back.coverage == pytest.approx(0.75)
    with pytest.raises(ValueError, match="BOS"):
        TrackedSet(type_ids=[0, 1], strings=["x", "y"], counts=[1, 1], bos_id=0, vocab_size=3)
