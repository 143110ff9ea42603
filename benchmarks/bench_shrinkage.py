"""Shrinkage of quantized outputs toward their mean: per output channel regression slopes.

Run from the repository root (project environment)::

    python benchmarks/bench_shrinkage.py --models mobilenetv2,person --variants shipped,gptq

For each model and rounding variant (``bench_rounding.py``'s ``--variants``) the XINT8 preset is
quantized and run on every test image; per output channel ``c`` (classifier: each logit; detector:
each of the six columns, objectness and person score also as logits ``log(p / (1 - p))``)::

    slope_qf = cov(q, f) / var(f)     (< 1: the quantized response is attenuated)
    slope_fq = cov(q, f) / var(q)     (1 for a conditional-mean (MMSE) estimate of f from q)

The table gives the median over channels of both, the mean error ``q - f`` of the largest logit
(classifier: the float argmax; detector: cells whose float score passes 0.3) and, for the
detector, how many cells pass the score threshold in each. Results:
``benchmarks/results/<name>.{txt,json}`` (``--name``, default ``shrinkage``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fidelity as bf
import bench_rounding as br
import common
import numpy as np


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p.astype(np.float64), 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def slopes(f: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per column of (samples, channels) arrays: cov/var(f) and cov/var(q)."""
    fc = f - f.mean(0)
    qc = q - q.mean(0)
    cov = np.sum(fc * qc, 0)
    vf = np.maximum(np.sum(fc * fc, 0), 1e-30)
    vq = np.maximum(np.sum(qc * qc, 0), 1e-30)
    return cov / vf, cov / vq


def measure(entry: bf.Entry, f: np.ndarray, q: np.ndarray) -> dict[str, Any]:
    row: dict[str, Any] = {"sqnr_db": round(common.sqnr_db(f.reshape(len(f), -1),
                                                           q.reshape(len(q), -1)), 2)}  # fmt: skip
    if entry.task == "detector":
        ff, qq = f.reshape(-1, f.shape[-1]).astype(np.float64), q.reshape(-1, q.shape[-1])
        qq = qq.astype(np.float64)
        for c in range(ff.shape[1]):
            a, b = ff[:, c : c + 1], qq[:, c : c + 1]
            if c >= 4:
                a, b = _logit(a), _logit(b)
            sq, sf = slopes(a, b)
            row[f"slope_qf_{c}"] = round(float(sq[0]), 4)
            row[f"slope_fq_{c}"] = round(float(sf[0]), 4)
        fs, qs = ff[:, 4] * ff[:, 5], qq[:, 4] * qq[:, 5]
        hot = fs > bf.DET_SCORE
        row["cells_float"] = int(hot.sum())
        row["cells_quant"] = int((qs > bf.DET_SCORE).sum())
        row["score_err_hot"] = round(float(np.mean(qs[hot] - fs[hot])), 4)
        for c in (4, 5):
            row[f"logit_err_hot_{c}"] = round(
                float(np.mean(_logit(qq[hot, c]) - _logit(ff[hot, c]))), 4
            )
        sq, _ = slopes(_logit(ff[hot, 4:6]), _logit(qq[hot, 4:6]))
        row["slope_qf_hot"] = [round(float(v), 4) for v in sq]
        row["detection"] = bf.detection_match(f, q)
        return row
    ff = f.reshape(len(f), -1).astype(np.float64)
    qq = q.reshape(len(q), -1).astype(np.float64)
    sq, sf = slopes(ff, qq)
    row["slope_qf_median"] = round(float(np.median(sq)), 4)
    row["slope_fq_median"] = round(float(np.median(sf)), 4)
    # one slope over all channels after removing each channel's mean
    fc, qc = ff - ff.mean(0), qq - qq.mean(0)
    row["slope_qf_pooled"] = round(float(np.sum(fc * qc) / np.sum(fc * fc)), 4)
    row["slope_fq_pooled"] = round(float(np.sum(fc * qc) / np.sum(qc * qc)), 4)
    top = ff.argmax(1)
    idx = np.arange(len(ff))
    row["top_logit_err"] = round(float(np.mean(qq[idx, top] - ff[idx, top])), 4)
    row["top_logit_mean"] = round(float(np.mean(ff[idx, top])), 4)
    srt = np.sort(ff, 1)
    qsrt = qq[idx, top] - np.max(np.where(np.arange(ff.shape[1]) == top[:, None], -np.inf, qq), 1)
    row["margin_float"] = round(float(np.mean(srt[:, -1] - srt[:, -2])), 4)
    row["margin_quant"] = round(float(np.mean(qsrt)), 4)
    if entry.labels is not None:
        row["top1"] = round(float(np.mean(qq.argmax(1) == entry.labels)), 4)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mobilenetv2,person")
    parser.add_argument("--variants", default="shipped,gptq")
    parser.add_argument("--name", default="shrinkage")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rows = []
    for model in args.models.split(","):
        entry = bf.load_entry(model)
        f_all = bf.run_all(bf.load_entry(entry.base).float_path, entry.test)
        f = next(iter(f_all.values()))
        for variant in args.variants.split(","):
            _, out, seconds, _ = br.quantize(entry, "preset", variant)
            q = next(iter(bf.run_all(out, entry.test).values()))
            row = {"model": model, "variant": variant, "quant_seconds": round(seconds, 1)}
            row.update(measure(entry, f, q))
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"argv": sys.argv[1:] if argv is None else argv, "commit": bf._git_commit(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    path = common.RESULTS_DIR / f"{args.name}.json"
    bf._atomic_text(path, json.dumps({"run": meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
