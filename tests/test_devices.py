"""Which GPUs each stage takes on an 8-GPU machine, faked: the flow's own CUDA_VISIBLE_DEVICES
(ids, UUIDs) mapped into every child's, a judge's GPU left to the judge, the held-out evaluation
on a GPU of its own beside the benchmark jobs, a model larger than one GPU sharded over several,
and each job's share of the CPUs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import small_config

import pipeline.threads
from flows.merit import branch_slots
from pipeline.devices import benchmark_gpus, eval_device, usable_gpus, visible_devices
from pipeline.eval.benchmarks import Slot, benchmark_slots, job_device, job_environment, model_args
from pipeline.eval.lmms_tasks import TaskPlan

JUDGE = "eval.judge={base_url: 'http://127.0.0.1:8000/v1', model: judge, gpus: [0]}"
PLAN = TaskPlan("toy_perception", (), (), None)


@pytest.fixture
def machine(monkeypatch):
    """8 GPUs of 40 GB and 16 CPUs, as this process sees them."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=40 * 10**9))
    monkeypatch.setattr(pipeline.threads, "available_cpus", lambda: 16)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return monkeypatch


def test_a_childs_devices_are_read_through_the_parents_list(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert visible_devices([2, 3]) == "2,3"
    assert visible_devices([0, 1], "4,5,6,7") == "4,5"  # indices into the caller's own visible set
    assert visible_devices([1], "GPU-aa,GPU-bb") == "GPU-bb"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2,3,4,5,6,7")  # the flow kept off GPU 0 (its judge's)
    assert visible_devices([0]) == "1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "3,5")  # a container's: already numbered 0, 1 inside it
    assert visible_devices([0, 1]) == "0,1"
    with pytest.raises(ValueError, match="GPU 2 asked for, but CUDA_VISIBLE_DEVICES=4,5 lets this process see 2"):
        visible_devices([2], "4,5")


def test_benchmark_jobs_get_the_gpus_they_were_given_through_the_flows_own_list(machine):
    cfg = small_config("eval.benchmark_processes=2")
    assert usable_gpus(cfg) == list(range(8)) and eval_device(cfg) == "cuda:0"
    assert benchmark_gpus(cfg) == [1, 2, 3, 4, 5, 6, 7]  # never the held-out evaluation's GPU
    slots = benchmark_slots(cfg, models=4)
    assert [s.gpus for s in slots] == [(1, 2), (3, 4), (5, 6)] and {s.processes for s in slots} == {2}
    assert {s.threads for s in slots} == {2}  # 16 CPUs among 6 ranks at once
    machine.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    assert job_environment(cfg, PLAN, slots[0])["CUDA_VISIBLE_DEVICES"] == "9,10"
    assert job_environment(cfg, PLAN, slots[0])["OMP_NUM_THREADS"] == "2"


def test_a_judges_gpu_is_left_to_the_judge_by_every_stage(machine):
    cfg = small_config(JUDGE, "train.processes=2")
    assert usable_gpus(cfg) == [1, 2, 3, 4, 5, 6, 7] and eval_device(cfg) == "cuda:1"
    assert branch_slots(cfg, 4) == [[1, 2], [3, 4], [5, 6]]
    slots = benchmark_slots(cfg, models=6)
    assert [s.gpus for s in slots] == [(2,), (3,), (4,), (5,), (6,), (7,)]
    machine.setattr(torch.cuda, "device_count", lambda: 2)  # one GPU left: evaluation and jobs share it
    assert eval_device(cfg) == "cuda:1" and [s.gpus for s in benchmark_slots(cfg, models=3)] == [(1,)]


def test_a_model_larger_than_one_gpu_is_benchmarked_in_one_process_across_several(machine, tiny_run):
    cfg = small_config()
    slots = benchmark_slots(cfg, models=3, model_bytes=60 * 10**9)  # 30B-A3B in bf16 on 40 GB cards
    assert [s.gpus for s in slots] == [(1, 2), (3, 4), (5, 6)]
    assert {(s.processes, s.sharded) for s in slots} == {(1, True)} and job_device(slots[0]) == "auto"
    assert model_args(cfg, str(tiny_run[1] / "init"), job_device(slots[0]))[1]["device_map"] == "auto"
    assert job_device(Slot(2, (1, 2))) == "cuda" and job_device(Slot(1, (1,))) == "cuda:0"
    with pytest.raises(
        ValueError, match="a model of 400.0 GB needs 13 GPUs of 40 GB for its benchmarks; the stage has 7"
    ):
        benchmark_slots(cfg, models=1, model_bytes=400 * 10**9)


def test_cpu_jobs_share_the_cpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(pipeline.threads, "available_cpus", lambda: 16)
    import pipeline.eval.benchmarks as benchmarks

    monkeypatch.setattr(benchmarks, "available_cpus", lambda: 16)
    slots = benchmark_slots(small_config("eval.benchmark_processes=2"), models=5)
    assert len(slots) == 8 and {(s.processes, s.threads, s.gpus) for s in slots} == {(2, 1, ())}
    assert eval_device(small_config()) == "cpu"
