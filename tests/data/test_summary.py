"""The data line `accelrun train` starts with: tokens, documents and sequences a pass."""

from accelrun.data.loader import TokenBatchIterator
from accelrun.data.mix import MixedBatchIterator
from accelrun.data.summary import describe_batches, describe_stream
from accelrun.data.text import load_text


def test_files_of_the_text_source_are_counted_as_the_documents_they_are(tmp_path):
    # data.source text: each file is one document, which a user of four .txt files had not known
    for i in range(3):
        (tmp_path / f"part{i}.txt").write_text("x" * (100 * (i + 1)))
    stream = load_text([str(tmp_path / "*.txt")], max_bytes=None)
    batches = TokenBatchIterator(stream, seq_len=8, micro_batch=2, seed=0)
    said = describe_batches(batches)
    whole_steps = (len(stream) - 1) // 8 // 2 * 2  # a pass reads whole steps of 2 sequences
    assert said == f"{len(stream):,} tokens in 3 documents, {whole_steps:,} sequences of 8 a pass"

    class Wrapper:  # context parallelism's batches hold the iterator as ``inner``
        inner = batches

    assert describe_batches(Wrapper()) == said
    mixed = MixedBatchIterator([stream, stream], [0.5, 0.5], seq_len=8, micro_batch=2, seed=0)
    assert describe_batches(mixed) == (f"source 0 (50% of the sequences): {describe_stream(stream)}; "
                                       f"source 1 (50% of the sequences): {describe_stream(stream)}")
    assert describe_batches(iter([])) is None


def test_more_steps_than_a_pass_say_how_many_passes_they_make(tmp_path):
    """A new user's 300 steps over 20 small files were 43 passes over them, and nothing said so."""
    (tmp_path / "a.txt").write_text("x" * 400)
    batches = TokenBatchIterator(load_text([str(tmp_path / "a.txt")], max_bytes=None), seq_len=8, micro_batch=2, seed=0)
    per_pass = batches.batches_per_epoch
    assert "passes" not in describe_batches(batches, steps=per_pass)
    said = describe_batches(batches, steps=10 * per_pass)
    assert said.endswith(f"; train.steps = {10 * per_pass:,} make 10.0 passes over it"), said
    # with gradient accumulation each step draws several batches (a review's finding)
    assert describe_batches(batches, steps=per_pass, draws_per_step=4).endswith("make 4.0 passes over it")


def test_a_mix_says_how_many_times_over_a_source_is_read(tmp_path):
    """A trial's small source at weight 0.3 was read about 11.5 times over in 30 steps, and nothing said so."""
    (tmp_path / "small.txt").write_text("x" * 200)  # 24 windows of 8
    (tmp_path / "big.txt").write_text("y" * 20000)
    small, big = (load_text([str(tmp_path / n)], max_bytes=None) for n in ("small.txt", "big.txt"))
    mixed = MixedBatchIterator([small, big], [0.3, 0.7], seq_len=8, micro_batch=4, seed=0)
    said = describe_batches(mixed, steps=100)  # 400 windows: 120 of the small source's 25
    assert "source 0 (30% of the sequences): " in said and ", read 4.8 times over in train.steps" in said, said
    assert said.count("times over") == 1  # the big one's 280 of 2,499 windows: less than once
