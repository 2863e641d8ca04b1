"""generate-dataset on a local Ray cluster of 2 CPU workers: 1 and 2 workers write the same tokens as
one process, and a worker killed mid-shard has its shard redone elsewhere (every image exactly once)."""
import os

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

import dataset_utils  # noqa: E402
from dataset_utils import failing_factory, read_all, write_tiny_checkpoints  # noqa: E402
from vvs_engine import VVSError, dataset  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    """One local cluster for the module: 2 CPUs, no dashboard, a small object store."""
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 1024 ** 2, log_to_driver=False,
             configure_logging=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    # The failing engine is defined in the tests: ship it by value to workers that cannot import it.
    ray.cloudpickle.register_pickle_by_value(dataset_utils)
    yield
    ray.cloudpickle.unregister_pickle_by_value(dataset_utils)
    ray.shutdown()


def test_one_and_two_workers_match_one_process(cluster, tmp_path):
    """Sampling at temperature 1, with a drafter (VVS): 1 process, 1 Ray worker and 2 Ray workers write the
    same shards and PNGs, byte for byte. (A tiny model from files: what runs on the workers is the engine
    the job describes; the Zoo model's own dataset runs are the README's, tests/test_newcomer.py.)"""
    tiny = write_tiny_checkpoints(str(tmp_path / "model"), drafter=True)
    job = dict(class_labels=[5, 2, 7], method="vvs", seed=4, shard_size=1, batch_size=1, threads=1, model=tiny,
               progress=False)
    runs = {}
    for name, kw in (("local", {}), ("ray1", {"ray": "auto", "workers": 1}), ("ray2", {"ray": "auto", "workers": 2})):
        s = dataset.generate(str(tmp_path / name), **job, **kw)
        assert s["workers"] == (kw.get("workers") or 1) and s["images_this_run"] == 3
        runs[name] = read_all(tmp_path / name)
    for name in ("ray1", "ray2"):
        assert np.array_equal(runs[name]["tokens"], runs["local"]["tokens"]), name
        assert runs[name]["index"].tolist() == [0, 1, 2] and runs[name]["labels"].tolist() == [5, 2, 7]
        for f in runs["local"]["pngs"] + runs["local"]["shards"]:  # the same files, byte for byte
            assert (tmp_path / name / f).read_bytes() == (tmp_path / "local" / f).read_bytes(), (name, f)
    assert ray.is_initialized()  # a cluster the job did not start is left running


def test_killed_worker_shard_is_retried(cluster, tmp_path):
    """A worker process dies in the middle of shard 1: the shard is redone by a fresh worker and the
    job finishes with every image exactly once, equal to an undisturbed run."""
    tiny = write_tiny_checkpoints(str(tmp_path))
    job = dict(class_labels=list(range(10)), shard_size=2, batch_size=1, seed=5, model=tiny, threads=1,
               progress=False)
    dataset.generate(str(tmp_path / "ref"), **job)
    marker = str(tmp_path / "killed-once")
    s = dataset.generate(str(tmp_path / "o"), ray="auto", workers=2, engine_factory=failing_factory(3, "exit", marker),
                         **job)
    assert os.path.exists(marker) and s["retries"] == 1 and s["images_this_run"] == 10
    got, ref = read_all(tmp_path / "o"), read_all(tmp_path / "ref")
    assert got["index"].tolist() == list(range(10)) and got["other"] == []
    assert np.array_equal(got["tokens"], ref["tokens"]) and got["pngs"] == ref["pngs"]


def test_failing_shard_gives_up_after_retries(cluster, tmp_path):
    """A shard that fails every time ends the job with one line; the other shards are kept."""
    tiny = write_tiny_checkpoints(str(tmp_path))
    with pytest.raises(VVSError, match="shard 2 failed 2 times.*simulated worker crash"):
        dataset.generate(str(tmp_path / "o"), class_labels=list(range(6)), shard_size=2, batch_size=1, model=tiny,
                         threads=1, progress=False, ray="auto", workers=1, max_retries=1,
                         engine_factory=failing_factory(4))
    got = read_all(tmp_path / "o")
    assert got["shards"] == ["shard-00000.npz", "shard-00001.npz"] and got["other"] == []
