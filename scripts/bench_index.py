"""Nearest-neighbour libraries for the semantic cache, measured as the cache uses them: one
vector added at a time, one nearest neighbour asked for, at dim 1536.

    .venv/bin/pip install faiss-cpu hnswlib   # usearch and numpy are the semantic extra
    .venv/bin/python scripts/bench_index.py usearch 10000 --dtype f16

Each run fills the index to ``n`` (all but the last ``--single`` vectors in one batch), then
times adding the last ones one by one (the insert time at that size), then 500 queries (a
stored vector plus noise, so the answer is known: recall@1), and reports the process's
resident memory the index added. Vectors: 1,000 clusters plus noise, normalised."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DIM = 1536


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def build(lib: str, n: int, dtype: str) -> tuple[Any, Any, Any, Any]:
    """(add one, add many, nearest, set the search's expansion) for ``lib``."""
    if lib == "usearch":
        from usearch.index import Index
        index = Index(ndim=DIM, metric="cos", dtype=dtype, connectivity=16,
                      expansion_add=128, expansion_search=64)
        return (lambda i, v: index.add(i, v), lambda ids, vs: index.add(ids, vs),
                lambda v: int(index.search(v, 1).keys[0]),
                lambda ef: setattr(index, "expansion_search", ef))
    if lib == "hnswlib":
        import hnswlib
        h = hnswlib.Index(space="ip", dim=DIM)
        h.init_index(max_elements=n, ef_construction=128, M=16, allow_replace_deleted=True)
        h.set_ef(64)
        return (lambda i, v: h.add_items(v.reshape(1, -1), [i]),
                lambda ids, vs: h.add_items(vs, ids),
                lambda v: int(h.knn_query(v, k=1)[0][0][0]), h.set_ef)
    if lib == "faiss":
        import faiss
        faiss.omp_set_num_threads(1)
        hnsw = faiss.IndexHNSWFlat(DIM, 16, faiss.METRIC_INNER_PRODUCT)
        hnsw.hnsw.efConstruction = 128
        hnsw.hnsw.efSearch = 64
        f = faiss.IndexIDMap2(hnsw)
        return (lambda i, v: f.add_with_ids(v.reshape(1, -1), np.array([i], dtype=np.int64)),
                lambda ids, vs: f.add_with_ids(vs, ids.astype(np.int64)),
                lambda v: int(f.search(v.reshape(1, -1), 1)[1][0][0]),
                lambda ef: setattr(hnsw.hnsw, "efSearch", ef))
    if lib == "store":  # the proxy's own: proxy.state.vectors over usearch f16, one scope
        from proxy.state.vectors import VectorStore
        store: Any = VectorStore(max_entries=n, ttl_s=3600)

        def add_all(ids: np.ndarray, vs: np.ndarray) -> None:
            for v in vs:
                store.add(b"scope", v, None, 0.0)

        def nearest_id(v: np.ndarray) -> int:
            found = store._scopes[b"scope"].nearest(v)
            return -1 if found is None else int(found[0])

        def tune(ef: int) -> None:
            index = store._scopes[b"scope"].index
            if index is not None:
                index.expansion_search = ef

        return lambda i, v: store.add(b"scope", v, None, 0.0), add_all, nearest_id, tune
    if lib == "numpy":  # exact: a matrix and a product
        rows = np.empty((n, DIM), dtype=np.float16 if dtype == "f16" else np.float32)
        count = [0]

        def add(i: int, v: np.ndarray) -> None:
            rows[i] = v
            count[0] = max(count[0], i + 1)

        def add_many(ids: np.ndarray, vs: np.ndarray) -> None:
            rows[ids] = vs
            count[0] = max(count[0], int(ids.max()) + 1)

        return (add, add_many, lambda v: int(np.argmax(rows[:count[0]] @ v.astype(rows.dtype))),
                lambda ef: None)
    raise SystemExit(f"unknown library {lib}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lib", choices=("usearch", "hnswlib", "faiss", "numpy", "store"))
    parser.add_argument("n", type=int)
    parser.add_argument("--dtype", default="f32", help="usearch: f32, f16, i8; numpy: f16")
    parser.add_argument("--single", type=int, default=1000)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    centres = rng.standard_normal((1000, DIM)).astype(np.float32)
    data = centres[rng.integers(0, 1000, args.n)]
    data += 0.3 * rng.standard_normal((args.n, DIM)).astype(np.float32)
    data /= np.linalg.norm(data, axis=1, keepdims=True)
    targets = rng.integers(0, args.n, 500)
    queries = data[targets] + 0.02 * rng.standard_normal((500, DIM)).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    gc.collect()
    base = rss_mb()
    add, add_many, nearest, tune = build(args.lib, args.n, args.dtype)
    bulk = args.n - args.single
    started = time.perf_counter()
    add_many(np.arange(bulk, dtype=np.uint64), data[:bulk])
    bulk_s = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(bulk, args.n):
        add(i, data[i])
    insert_us = (time.perf_counter() - started) / args.single * 1e6
    memory = rss_mb() - base
    queried = []
    for ef in (64, 128):
        tune(ef)
        started = time.perf_counter()
        found = [nearest(q) for q in queries]
        query_us = (time.perf_counter() - started) / len(queries) * 1e6
        recall = float(np.mean(np.array(found) == targets))
        queried.append(f"ef {ef}: query {query_us:.0f} us, recall@1 {recall:.3f}")
    print(f"{args.lib} {args.dtype} n={args.n}: insert {insert_us:.0f} us/entry "
          f"(bulk {bulk_s:.1f} s), {'; '.join(queried)}; memory {memory:.0f} MB "
          f"(the f32 vectors alone: {args.n * DIM * 4 / 2**20:.0f} MB)", flush=True)


if __name__ == "__main__":
    main()
