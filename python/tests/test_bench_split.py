"""memplan.torch.bench_split: its torchtune-style chunked loss is the
Hugging Face loss, and its meta-device comparison runs end to end."""

import types
import unittest

import torch

from memplan.torch import bench_split


def _args(**kw):
    base = dict(meta=True, layers=1, hidden=32, intermediate=64, heads=2, kv_heads=1, vocab=512, tied=True,
                seq=64, batch=2, bf16=False, chunks=None, time_limit=5.0)
    base.update(kw)
    return types.SimpleNamespace(**base)


class BenchSplit(unittest.TestCase):
    def test_chunked_ce_is_the_hugging_face_loss(self):
        args = _args(meta=False)
        model = bench_split._model(args)
        b = torch.randint(0, args.vocab, (2, 64), generator=torch.Generator().manual_seed(0))
        hf = bench_split.hf_loss(args)(model, b)
        chunked = bench_split.chunked_ce_loss(args)(model, b)
        torch.testing.assert_close(chunked, hf, rtol=1e-6, atol=1e-6)

    def test_meta_comparison(self):
        out = bench_split.run(_args())
        for side in ("unsplit", "chunked-ce", "split"):
            self.assertGreater(out[side]["arena_bytes"], 0)
            self.assertGreaterEqual(out[side]["max_live_bytes"], out[side]["lower_bound_bytes"])
        self.assertLessEqual(out["split"]["arena_bytes"], out["unsplit"]["arena_bytes"])
        self.assertEqual(out["split"]["split"]["tried"][0]["chunks"], 1)
        self.assertGreaterEqual(out["summary"]["split_below_unsplit"], 0.0)


if __name__ == "__main__":
    unittest.main()
