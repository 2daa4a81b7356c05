import pytest
import tensorflow as tf

from tf_gradsync.bucketing import plan_buckets


def test_reverse_order_dtype_groups_and_bound():
    specs = [((3, 4), tf.float32), ((4,), tf.float32), ((100,), tf.float16), ((1000,), tf.float32),
             ((5,), tf.float16)]
    plan = plan_buckets(specs, 100)
    got = [(b.dtype, [s.index for s in b.slots]) for b in plan.buckets]
    # Visited last-to-first; a tensor over the bound gets its own bucket; dtypes never mix.
    assert got == [(tf.float16, [4]), (tf.float32, [3]), (tf.float16, [2]),
                   (tf.float32, [1, 0])]
    for b in plan.buckets:
        assert b.nbytes <= 100 or len(b.slots) == 1


def test_plan_is_deterministic_and_fingerprinted():
    specs = [((7, 3), tf.float32), ((2,), tf.float64)]
    a, b = plan_buckets(specs, 64), plan_buckets(list(specs), 64)
    assert a == b and a.fingerprint == b.fingerprint
    assert plan_buckets(specs, 65).fingerprint != a.fingerprint


@pytest.mark.parametrize("bad", [0, -1, 1.5, None])
def test_bad_bucket_bytes(bad):
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets([((2,), tf.float32)], bad)


def test_unknown_shape_is_rejected():
    with pytest.raises(ValueError, match="fully defined"):
        plan_buckets([((None, 3), tf.float32)], 64)


# Pack/unpack round trips for arbitrary shapes, dtypes and bounds: the property test in
# tests/test_validation.py.
