"""``merit bench diloco``'s building blocks: the stdlib corpus and its file-level split, and one
round of plain averaging, checked against the workers' weights averaged by hand; ``merit bench
aggregators``' bytes against their arithmetic."""

from types import SimpleNamespace

import pytest
import torch

from pipeline.bench.diloco import (
    CLIP,
    CONTEXT,
    EOD,
    MAX_FILE_BYTES,
    Learner,
    load_corpus,
    run_diloco,
    shard_batches,
    tiny_qwen2,
)


def test_corpus_is_deterministic_with_disjoint_files_and_byte_windows():
    corpus, again = load_corpus(), load_corpus()
    assert corpus.train_files == again.train_files and corpus.heldout_files == again.heldout_files
    assert torch.equal(corpus.heldout, again.heldout)
    assert corpus.heldout_files and not set(corpus.train_files) & set(corpus.heldout_files)
    assert max(len(f) for f in corpus.train_files + corpus.heldout_files) < 100  # names, not paths
    sizes = [(corpus.root / f).stat().st_size for f in corpus.train_files + corpus.heldout_files]
    assert max(sizes) <= MAX_FILE_BYTES and sum(sizes) == corpus.train_bytes + corpus.heldout_bytes
    assert 0.02 < corpus.heldout_bytes / (corpus.train_bytes + corpus.heldout_bytes) < 0.15
    for windows in (corpus.train, corpus.heldout):
        assert windows.shape[1] == CONTEXT + 1 and windows.min() >= 0 and windows.max() == EOD
        assert torch.equal(windows[:-1, -1], windows[1:, 0])  # consecutive windows share one id


def test_averaging_sets_the_global_weights_to_the_workers_mean():
    torch.manual_seed(1)
    train, heldout = torch.randint(0, EOD + 1, (40, CONTEXT + 1)), torch.randint(0, EOD + 1, (4, CONTEXT + 1))
    model0 = tiny_qwen2()
    run = run_diloco(model0, train, heldout, workers=2, inner_steps=2, rounds=1, method="average")

    learners = [Learner(tiny_qwen2(), steps=2) for _ in range(2)]
    for learner, stream in zip(learners, shard_batches(len(train), 2, seed=0)):
        learner.train(train[next(stream)] for _ in range(2))
    trained = [learner.model.state_dict() for learner in learners]
    for name, theta in run.model.state_dict().items():
        torch.testing.assert_close(theta, (trained[0][name] + trained[1][name]) / 2, rtol=0, atol=1e-6)
        assert not torch.equal(trained[0][name], trained[1][name])  # the shards differ
    params = sum(p.numel() for p in model0.parameters())
    assert run.curve[0]["bytes_sent"] == 2 * 4 * params


def test_a_learner_clips_its_gradients_before_each_step():
    """The bench trains as the trainer does: gradient norm clipped to 1.0 before AdamW's step."""
    model = tiny_qwen2()
    with torch.no_grad():
        model.lm_head.weight.mul_(50)  # gradients far above the clip
    learner, seen = Learner(model, steps=2), []

    def before_step(optimizer, args, kwargs):
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))

    learner.optimizer.register_step_pre_hook(before_step)
    batch = torch.randint(0, EOD + 1, (2, CONTEXT + 1), generator=torch.Generator().manual_seed(0))
    norms = learner.train([batch, batch])
    assert min(norms) > 10 * CLIP and seen == pytest.approx([CLIP, CLIP], rel=1e-4)


def test_bench_aggregators_measures_a_share_of_every_payload_per_aggregator(tmp_path, capsys):
    """One aggregator reads every payload twice, θ and the momentum: (2R + 2) payloads' bytes
    (fp32, every tensor trained); S aggregators each about 1/S of it."""
    from pipeline.bench.aggregators import main

    main(SimpleNamespace(workers=[2], size="small", compression="none", method="iso_c", workdir=str(tmp_path)))
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| 2 |")]
    read = {int(row[1]): float(row[3]) for row in rows}
    payload = float(rows[0][2])
    assert sorted(read) == [1, 2] and payload > 1
    assert read[1] == pytest.approx(6 * payload, rel=0.02)
    assert 0.5 * read[1] <= read[2] <= 0.6 * read[1]
    assert not any(tmp_path.iterdir())  # θ0 and the payloads went with the bench
