"""``merit bench diloco``'s building blocks: the stdlib corpus and its file-level split, and one
round of plain averaging, checked against the workers' weights averaged by hand."""

import torch

from pipeline.bench.diloco import CONTEXT, EOD, Learner, load_corpus, run_diloco, shard_batches, tiny_qwen2


def test_corpus_is_deterministic_with_disjoint_files_and_byte_windows():
    corpus, again = load_corpus(), load_corpus()
    assert corpus.train_files == again.train_files and corpus.heldout_files == again.heldout_files
    assert torch.equal(corpus.heldout, again.heldout)
    assert corpus.heldout_files and not set(corpus.train_files) & set(corpus.heldout_files)
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
