"""accelrun generate: sampling from a tiny trained run's newest checkpoint."""

from __future__ import annotations

from click.testing import CliRunner

from accelrun.cli.main import cli
from accelrun.config import load_config
from accelrun.train.entry import train
from tests.conftest import DEFAULT_CONFIG


def test_generate_is_deterministic_for_a_seed_and_refuses_a_run_without_checkpoints(tiny):
    done = train(load_config(DEFAULT_CONFIG, tiny(4, "checkpoint.every=2", "name=gen")), command="test").run_dir
    runner = CliRunner()
    args = ["generate", str(done), "--prompt", "The ", "--max-new-tokens", "24", "--temperature", "1.0",
            "--top-k", "40"]
    a = runner.invoke(cli, [*args, "--seed", "3"])
    b = runner.invoke(cli, [*args, "--seed", "3"])
    c = runner.invoke(cli, [*args, "--seed", "4"])
    assert a.exit_code == 0, a.output
    assert a.stdout == b.stdout and a.stdout.startswith("The ")
    assert c.exit_code == 0 and c.stdout != a.stdout  # the seed is what fixes the text
    greedy = runner.invoke(cli, [*args[:-4], "--temperature", "0"])
    assert greedy.exit_code == 0 and greedy.stdout.startswith("The ")
    # Which run and checkpoint it sampled from, on stderr (stdout is the text alone).
    newest = done / "checkpoints" / "step-000004"
    assert a.stderr.startswith(f"run {done}; step 4; checkpoint {newest}; 24 tokens in "), a.stderr
    assert "KV cache)" in a.stderr and "warning" not in a.stderr
    # Past the windows it trained on (train.seq_len of the tiny recipe), its positions are untrained: said.
    seq_len = load_config(DEFAULT_CONFIG, tiny(4)).config.train.seq_len
    far = runner.invoke(cli, [*args[:4], "--max-new-tokens", str(seq_len)])  # BOS + "The " + seq_len new ones
    assert far.exit_code == 0 and (f"more than the {seq_len} of the windows it trained on" in
                                   " ".join(far.stderr.split())), far.stderr
    near = runner.invoke(cli, [*args[:4], "--max-new-tokens", str(seq_len - 4)])  # fed: BOS + 4 + (n - 1) = seq_len
    assert near.exit_code == 0 and "warning" not in near.stderr, near.stderr

    bare = train(load_config(DEFAULT_CONFIG, tiny(2, "checkpoint.enabled=false", "name=bare")),
                 command="test").run_dir
    r = runner.invoke(cli, ["generate", str(bare), "--prompt", "x"])
    assert r.exit_code == 2
    assert "no complete checkpoint" in r.output and "Traceback" not in r.output
    assert "it trained with checkpoint.enabled = false, so it saved none" in " ".join(r.output.split())


def test_a_folder_of_runs_samples_from_its_newest_run_that_saved_a_checkpoint(tiny):
    """A new user's quick try with checkpoints off, after the real run, made `accelrun generate
    runs/llama-debug` refuse the whole folder and say to train again."""
    saved = train(load_config(DEFAULT_CONFIG, tiny(2, "checkpoint.every=2")), command="test").run_dir
    quick = train(load_config(DEFAULT_CONFIG, tiny(2, "checkpoint.enabled=false")), command="test").run_dir
    assert quick.parent == saved.parent
    r = CliRunner().invoke(cli, ["generate", str(saved.parent), "--prompt", "x", "--max-new-tokens", "4"])
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith(f"run {saved}; step 2;"), r.stderr
    assert "holds" not in r.stderr  # one run with a checkpoint: nothing else to name
    r = CliRunner().invoke(cli, ["generate", str(quick), "--prompt", "x"])  # the run itself, named: refused
    assert r.exit_code == 2 and "no complete checkpoint" in r.output
    # A shorter try saved after the long run: the newest is used, and the longest named (a trial's
    # generate spoke from a 20-step try beside the 300-step run, without a word)
    short = train(load_config(DEFAULT_CONFIG, tiny(1, "checkpoint.every=1")), command="test").run_dir
    r = CliRunner().invoke(cli, ["generate", str(saved.parent), "--prompt", "x", "--max-new-tokens", "4"])
    said = " ".join(r.stderr.split())
    assert r.exit_code == 0 and r.stderr.startswith(f"run {short}; step 1;"), r.stderr
    assert (f"note: {saved.parent} holds 2 runs with checkpoints: this is its newest; the one trained longest is "
            f"{saved} (step 2); name a run folder to use another") in said, said


def test_generate_refuses_a_tokenizer_file_that_changed_since_the_run_trained(tiny, tmp_path):
    # A new user replaced the run's tokenizer.json (vocab 400) by another (vocab 300): generate decoded the
    # model's ids with it and printed other text, exit 0 (resume refused the same change).
    from tests.data.chat_helpers import save_chat_tokenizer

    tok = tmp_path / "tok"
    save_chat_tokenizer(tok)
    done = train(load_config(DEFAULT_CONFIG, tiny(2, f"data.tokenizer={tok}", "checkpoint.every=2", "name=tok")),
                 command="test").run_dir
    args = ["generate", str(done), "--prompt", "hello", "--max-new-tokens", "4"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    save_chat_tokenizer(tok, vocab_size=280)  # another tokenizer under the same name
    r = CliRunner().invoke(cli, args)
    said = " ".join(r.output.split())
    assert r.exit_code == 2 and "is not the tokenizer the run trained with (its checkpoint says hf-" in said, said


def test_sampling_stops_at_the_end_of_a_text_unless_told_to_go_through():
    # A new user's sample glued one document's end to the next one's start ("word.Of"): the end-of-text id
    # was sampled, dropped by the decoder, and sampling went on.
    import torch

    from accelrun.train.generate import generate

    class EndsAtOnce(torch.nn.Module):
        def forward(self, ids_1T):
            logits = torch.zeros(1, ids_1T.shape[1], 258)
            logits[..., 257] = 10.0  # the byte tokenizer's end of text
            return logits

    model = EndsAtOnce()
    assert generate(model, [256, 65], max_new_tokens=5, temperature=0, stop_id=257) == [256, 65, 257]
    assert generate(model, [256, 65], max_new_tokens=5, temperature=0) == [256, 65] + [257] * 5
