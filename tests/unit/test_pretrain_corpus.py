"""The pre-training corpus and batches, without a sandbox: first-turn documents are exactly the agent
loop's tokens, solutions lose only their docstring, the shared-prefix loss equals the full-sequence loss,
batches replay from the step number, and the config hash tells models apart."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from realtime_rl.config import ModelConfig, PretrainConfig, load_config
from realtime_rl.environments import generate_task, load_task
from realtime_rl.environments.synthetic import reserved_structure, structure_split, task_set
from realtime_rl.environments.synthetic_ops import structure_name, structures
from realtime_rl.model import Qwen3ForCausalLM, Tokenizer, parse_assistant
from realtime_rl.model.qwen3 import ModelOutput
from realtime_rl.train.base_eval import heldout_tasks, teacher_forced_misses, wilson_interval
from realtime_rl.train.corpus import (
    CorpusWorkers, MemoryTask, _solution, build_followup_documents, build_write_documents, classify_solution,
    commented, renamed, shared_prefix_length, stage_comments, synthetic_tasks, tasks_per_difficulty, tokenizer_texts,
    without_docstring, wrong_stage_comment,
)
from realtime_rl.train.data_parallel import share
from realtime_rl.train.packing import cheapest_cut
from realtime_rl.train.pretrain import (
    MICRO_BATCH_OVERHEAD_TOKENS, MICRO_BATCH_TOKENS, batch_for_step, config_hash, masked_next_token_loss,
    micro_batches, prefix_cache, processes_for, step_documents,
)


def _module(source: str, name: str):
    namespace: dict = {}
    exec(source, namespace)  # our own generated module
    return namespace[name]


def _tasks(tmp_path, count=12):
    return list(synthetic_tasks(count, max_difficulty=2, seed=0))


def _tokenizer(tasks):
    return Tokenizer.train(tokenizer_texts(tasks, random.Random(0)), vocab_size=1024)


def _passes_its_tests(task) -> bool:
    name = task.metadata["function"]
    function = _module(task.reference_solution()[task.solution_files[0]], name)
    for tests in [*task.pristine_tests().values(), *task.hidden_tests().values()]:
        assert f"from {name} import {name}" in tests
        for line in tests.splitlines():
            if line.strip().startswith("assert "):
                try:
                    exec(line.strip(), {name: function})  # our own generated tests
                except AssertionError:
                    return False
    return all(function(case.input) == case.expected for case in task.value_cases().cases)  # the tests as data


def test_a_corpus_that_reserves_structures_leaves_out_exactly_theirs():
    plain = [task.task_id for task in synthetic_tasks(40, max_difficulty=2, seed=0)]
    assert plain == [f"syn-train-d{1 + i % 2}-{i // 2:06d}" for i in range(40)]  # unchanged when none is reserved
    tasks = list(synthetic_tasks(200, max_difficulty=2, seed=0, reserve_structures=True))
    assert {task_set(task.metadata["structure"]) for task in tasks} == {"train"}
    kept = {d: [i for i in range(400) if not reserved_structure(
        generate_task(i, "train", 0, difficulty=d).metadata["structure"])][:100] for d in (1, 2)}
    assert [task.task_id for task in tasks] == [f"syn-train-d{1 + i % 2}-{kept[1 + i % 2][i // 2]:06d}"
                                                for i in range(200)]  # every other task in order, none skipped
    assert kept[1][-1] > 99 and kept[2][-1] > 99  # and some were reserved
    later = [task.task_id for task in synthetic_tasks(20, max_difficulty=2, seed=0, start=180, reserve_structures=True)]
    assert later == [task.task_id for task in tasks[180:]]


def test_difficulty_weights_set_how_many_tasks_of_each_difficulty_a_cycle_takes():
    tasks = [task.task_id for task in synthetic_tasks(16, 2, seed=0, difficulty_weights=(1, 3))]
    assert tasks == [f"syn-train-d{d}-{i:06d}"
                     for c in range(4) for d, i in ((1, c), (2, 3 * c), (2, 3 * c + 1), (2, 3 * c + 2))]
    later = synthetic_tasks(4, 2, seed=0, start=4, difficulty_weights=(1, 3))
    assert tasks[4:8] == [task.task_id for task in later]
    even = [task.task_id for task in synthetic_tasks(10, max_difficulty=2, seed=0, difficulty_weights=(1, 1))]
    assert even == [task.task_id for task in synthetic_tasks(10, max_difficulty=2, seed=0)]
    assert tasks_per_difficulty(16, 2, (1, 3)) == {1: 4, 2: 12} and tasks_per_difficulty(9, 2) == {1: 5, 2: 4}
    assert tasks_per_difficulty(10, 2, (1, 3)) == {1: 3, 2: 7}
    only_two = synthetic_tasks(6, 2, seed=0, difficulty_weights=(0, 1))
    assert {task.metadata["difficulty"] for task in only_two} == {2}
    for bad in ((1,), (1, 2, 3), (0, 0), (1, -1)):
        with pytest.raises(ValueError, match="difficulty_weights"):
            PretrainConfig(difficulty_weights=bad)
    assert config_hash(PretrainConfig(difficulty_weights=None)) != config_hash(PretrainConfig())


def test_a_corpus_that_excludes_held_out_parts_skips_only_the_longer_structures_that_hold_them():
    held_out = {structure_name(ops) for ops in structures() if structure_split(structure_name(ops)) == "heldout"}
    tasks = list(synthetic_tasks(60, max_difficulty=3, seed=0, exclude_heldout_parts=True))
    plain = list(synthetic_tasks(60, max_difficulty=3, seed=0))
    for task, other in zip(tasks, plain):
        if task.metadata["difficulty"] < 3:
            assert task.task_id == other.task_id  # one- and two-stage tasks are the same
        else:
            stages = task.metadata["structure"].split(" -> ")
            assert not held_out & {" -> ".join(stages[:2]), " -> ".join(stages[1:])}
    assert [t.task_id for t in tasks] != [t.task_id for t in plain]  # some three-stage tasks were skipped
    assert config_hash(PretrainConfig()) == config_hash(PretrainConfig(exclude_heldout_parts=False))
    assert config_hash(PretrainConfig()) != config_hash(PretrainConfig(exclude_heldout_parts=True))


def test_the_recipes_difficulty_weights_are_for_two_difficulties_and_other_configs_go_round_robin():
    assert PretrainConfig().difficulty_weights == (1, 7)
    one = PretrainConfig(max_difficulty=1)  # the demo's base: its hash (and cached model) stays round robin's
    assert one.difficulty_weights is None
    assert config_hash(one) == config_hash(PretrainConfig(max_difficulty=1, difficulty_weights=None))
    assert PretrainConfig(max_difficulty=3).difficulty_weights is None
    assert PretrainConfig(max_difficulty=3, difficulty_weights=(1, 2, 2)).difficulty_weights == (1, 2, 2)
    with pytest.raises(ValueError, match="difficulty_weights"):
        PretrainConfig(max_difficulty=1, difficulty_weights=(1, 7))


def test_renamed_tasks_are_the_same_task_under_another_name():
    for i in range(40):
        original = generate_task(i, "train", 0, difficulty=1 + i % 3)
        task = MemoryTask.of(renamed(original, "get_spread_odds"))
        assert task.metadata["function"] == "get_spread_odds" and task.metadata["structure"] == original.metadata["structure"]
        assert task.solution_files == ("get_spread_odds.py",) and task.test_files == ("get_spread_odds_test.py",)
        assert task.instructions.startswith("# Get spread odds\n")
        assert "`get_spread_odds(" in task.instructions and f"`{original.metadata['function']}(" not in task.instructions
        assert set(task.workspace()) == {"get_spread_odds.py", "get_spread_odds_test.py"}
        cases, before = task.value_cases(), MemoryTask.of(original).value_cases()
        assert (cases.module, cases.function) == ("get_spread_odds",) * 2
        assert [(c.input, c.expected) for c in cases.cases] == [(c.input, c.expected) for c in before.cases]
        assert _passes_its_tests(task)
        for novice in task.novice_files:
            _module(task.read(novice), "get_spread_odds")


def test_corpus_tasks_mix_generated_and_random_names(tmp_path):
    tasks = _tasks(tmp_path, 40)
    kept = sum(t.metadata["function"] == generate_task(t.metadata["index"], "train", 0,
                                                          difficulty=t.metadata["difficulty"]).metadata["function"]
               for t in tasks)
    assert 5 < kept < 35 and all(_passes_its_tests(t) for t in tasks)


def test_memory_tasks_read_like_their_written_directories(tmp_path):
    for i in range(4):
        task = MemoryTask.of(generate_task(i, "train", 0, difficulty=2))
        on_disk = load_task(generate_task(i, "train", 0, difficulty=2).write(tmp_path))
        assert task.task_id == on_disk.task_id and task.instructions == on_disk.instructions
        assert task.workspace() == on_disk.workspace() and task.reference_solution() == on_disk.reference_solution()
        assert (task.solution_files, task.test_files, task.novice_files) == (
            on_disk.solution_files, on_disk.test_files, on_disk.novice_files)
        assert [task.read(f) for f in task.novice_files] == [on_disk.read(f) for f in on_disk.novice_files]


def test_solutions_carry_one_comment_per_stage_instead_of_the_docstring(tmp_path):
    for task in _tasks(tmp_path, 30):
        name, stages = task.metadata["function"], task.metadata["difficulty"]
        reference = task.reference_solution()[task.solution_files[0]]
        written = commented(reference, instructions=task.instructions)
        assert '"""' not in written and written.count("    # ") == stages
        code = [line for line in written.splitlines() if not line.lstrip().startswith("#")]
        assert "\n".join(code) + "\n" == without_docstring(reference)  # the code itself is untouched
        for bug in task.metadata["novice_bugs"]:  # novices keep every comment, even of a step they skip
            missing = bug["stage"] - 1 if bug["kind"] == "missing_step" else None
            novice = commented(task.read(bug["file"]), missing, task.instructions)
            assert novice.count("    # ") == stages
            assert [c for c in novice.splitlines() if "#" in c] == [c for c in written.splitlines() if "#" in c]
            _module(novice, name)
        comments = [line.removeprefix("    # ") for line in written.splitlines() if line.startswith("    # ")]
        assert all(c in " ".join(task.instructions.split()) for c in comments)  # the instructions' own words
        assert callable(_module(written, name))


def test_a_docstring_wrapped_at_a_hyphen_gives_the_instructions_word_whole():
    """textwrap breaks a docstring after a hyphen; the comment joins the word again, as the instructions write it."""
    source = ('def words(text: str) -> list[str]:\n    """Break the text into its whitespace-\n    separated words; '
              'return the resulting list of strings."""\n    return text.split()\n')
    written = commented(source, instructions="Given a string `text`, it should break the text into its "
                                             "whitespace-separated words.")
    assert written.splitlines()[1] == "    # break the text into its whitespace-separated words"


def test_classify_solution_names_the_script_that_wrote_a_first_attempt(tmp_path):
    """Every solution the corpus writes is classified as what it is; anything else is the model's own code."""
    kinds = set()
    for task in _tasks(tmp_path, 30):
        assert classify_solution(task, _solution(task, True, random.Random(1))) == "reference"
        assert classify_solution(task, _solution(task, True, random.Random(1)) + "\n\n") == "reference"
        for k in range(8):
            novice = _solution(task, False, random.Random(k))
            kind = classify_solution(task, novice)
            assert kind.startswith("novice:") and kind.removeprefix("novice:") in {
                b["kind"] for b in task.metadata["novice_bugs"]}
            kinds.add(kind)
        reference = _solution(task, True, random.Random(0))
        assert classify_solution(task, reference.replace("    return", "    return -1 +", 1)) == "other"
        assert classify_solution(task, None) == "none"
    assert len(kinds) == 4  # every bug kind was met and told apart


def test_wrong_stage_comment_names_the_first_stage_whose_comment_is_not_the_instructions_step(tmp_path):
    for task in _tasks(tmp_path, 20):
        stages = task.metadata["difficulty"]
        reference = _solution(task, True, random.Random(0))
        assert wrong_stage_comment(task, reference) == 0
        assert wrong_stage_comment(task, reference.upper().replace("DEF ", "def ")) == 0  # case aside
        wrong_code = reference.replace("    return", "    return -1 +", 1)
        assert wrong_stage_comment(task, wrong_code) == 0  # the code is not judged
        assert wrong_stage_comment(task, None) is None
        comments = [line for line in reference.splitlines() if line.lstrip().startswith("#")]
        assert len(comments) == stages
        last = reference.replace(comments[-1], "    # keep only the numbers greater than 99")
        assert wrong_stage_comment(task, last) == stages
        assert wrong_stage_comment(task, reference.replace(comments[0] + "\n", "", 1)) == 1  # one left out
        assert wrong_stage_comment(task, reference + "    # and one more stage\n") == stages + 1
        for bug in task.metadata["novice_bugs"]:  # a novice keeps every stage's comment
            missing = bug["stage"] - 1 if bug["kind"] == "missing_step" else None
            novice = commented(task.read(bug["file"]), missing, task.instructions)
            assert wrong_stage_comment(task, novice) == 0


def _sleeping_chunk(items: list[int], seconds: float) -> list[int]:
    time.sleep(seconds)
    return items


def test_a_corpus_phase_past_its_timeout_fails_and_its_processes_are_killed():
    """Leaving the `with` block on the timeout kills the chunks still running instead of waiting them out."""
    start = time.monotonic()
    with pytest.raises(TimeoutError), CorpusWorkers(2, timeout_s=1.0) as workers:
        workers.map(_sleeping_chunk, list(range(8)), 300.0)
    assert time.monotonic() - start < 120  # not the chunks' 300 s


def test_write_documents_are_the_loops_first_turn(tmp_path):
    tasks = _tasks(tmp_path)
    tokenizer = _tokenizer(tasks)
    docs = build_write_documents(tasks, tokenizer, expert_fraction=0.5, seed=0)
    assert len(docs) == len(tasks) and {d.expert for d in docs} == {True, False}
    for task, doc in zip(tasks, docs):
        text = tokenizer.decode(doc.token_ids.tolist())
        assert text.startswith("<|im_start|>system") and task.instructions.strip() in text
        assert doc.loss_mask[-1] and text.endswith("</tool_call><|im_end|>")  # cut after the assistant turn
        written = tokenizer.decode(doc.token_ids[doc.loss_mask].tolist())
        assert '"name": "write_file"' in written and "<tool_response>" not in text
        reference = commented(task.reference_solution()[task.solution_files[0]], instructions=task.instructions)
        if doc.expert:
            assert reference.replace("\n", "\\n") in written.replace('\\"', '"')


def test_question_documents_ask_a_well_formed_clarifying_question(tmp_path):
    tasks = _tasks(tmp_path, 40)
    tokenizer = _tokenizer(tasks)
    docs = build_write_documents(tasks, tokenizer, expert_fraction=1.0, seed=0, question_fraction=0.25)
    asked = 0
    for task, doc in zip(tasks, docs):
        parsed = parse_assistant(tokenizer.decode(doc.token_ids[doc.loss_mask].tolist()).removesuffix("<|im_end|>"))
        assert not parsed.errors and len(parsed.tool_calls) == 1
        call = parsed.tool_calls[0].function
        if call.name == "ask_user":
            asked += 1
            assert task.metadata["function"] in json.loads(call.arguments)["question"]
        else:
            assert call.name == "write_file"
    assert 4 <= asked <= 18  # ~25% of 40


def test_followup_documents_are_the_second_turn_users_ask_for(tmp_path):
    """The prompt is what the gateway encodes for the follow-up request a simulated user sends (the first turn,
    its tool result, the complaint or the answer), the target the reference write_file; loss on it only."""
    from realtime_rl.environments.agent_loop import first_turn_messages
    from realtime_rl.environments.tools import TOOL_SCHEMAS
    from realtime_rl.model import render_messages

    tasks = _tasks(tmp_path, 24)
    tokenizer = _tokenizer(tasks)
    docs = build_followup_documents(tasks, tokenizer, seed=0, question_fraction=0.3)
    kinds = set()
    for task, doc in zip(tasks, docs):
        start = int(np.flatnonzero(doc.loss_mask)[0])
        assert doc.loss_mask[start:].all() and not doc.loss_mask[:start].any() and doc.expert
        first_turn = tokenizer.encode(render_messages(first_turn_messages(task), TOOL_SCHEMAS))
        assert doc.token_ids[:len(first_turn)].tolist() == first_turn  # the conversation the users opened
        prompt = tokenizer.decode(doc.token_ids[:start].tolist())
        assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n") and prompt.count("<|im_start|>assistant") == 2
        path = task.solution_files[0]
        if "Please fix" in prompt:
            kinds.add("failed")
            assert f"so I reverted your change. Please fix {path}." in prompt and f"wrote {path}" in prompt
        else:
            kinds.add("question")
            assert '"name": "ask_user"' in prompt and "No further constraints" in prompt
        parsed = parse_assistant(tokenizer.decode(doc.token_ids[start:].tolist()).removesuffix("<|im_end|>"))
        assert not parsed.errors and [c.function.name for c in parsed.tool_calls] == ["write_file"]
        written = json.loads(parsed.tool_calls[0].function.arguments)
        reference = commented(task.reference_solution()[path], instructions=task.instructions)
        assert written == {"path": path, "content": reference}
    assert kinds == {"failed", "question"}


def test_prefix_cached_loss_equals_the_full_sequence_loss(tmp_path):
    tasks = _tasks(tmp_path, 8)
    tokenizer = _tokenizer(tasks)
    docs = build_write_documents(tasks, tokenizer, expert_fraction=0.5, seed=0)
    prefix_len = shared_prefix_length(docs, limit=4096)
    assert 100 < prefix_len < min(int(np.flatnonzero(d.loss_mask)[0]) for d in docs)
    model = Qwen3ForCausalLM(ModelConfig(vocab_size=1024, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                                         moe_intermediate_size=16, tie_word_embeddings=False))
    model.reset_parameters(seed=0)
    pad = tokenizer.pad_token_id
    (full_ids, full_mask), = batch_for_step(docs, 0, 4, seed=0, pad_id=pad)
    (ids, mask), = batch_for_step(docs, 0, 4, seed=0, pad_id=pad, prefix_len=prefix_len)
    prefix = prefix_cache(model, torch.from_numpy(docs[0].token_ids[:prefix_len].astype(np.int64)))
    full = masked_next_token_loss(model, full_ids, full_mask)
    cached = masked_next_token_loss(model, ids, mask, prefix)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)
    cached.backward()  # gradients reach the weights through the suffix
    assert all(p.grad is not None for p in model.parameters())


def test_the_shared_prefix_stops_before_the_input_of_the_first_trained_token():
    """Token t is trained as the prediction of input t - 1: a prefix that held input t - 1 (it runs without
    the LM head) would leave token t untrained."""
    from realtime_rl.train.corpus import Document

    ids, mask = np.arange(12, dtype=np.int32), np.arange(12) >= 5
    docs = [Document(ids, mask, True), Document(ids.copy(), mask.copy(), False)]
    assert shared_prefix_length(docs, limit=4096) == 4
    assert shared_prefix_length([Document(ids, np.ones(12, bool), True)], limit=4096) == 0


def test_batches_replay_from_the_step_and_stay_within_the_token_budget(tmp_path):
    tasks = _tasks(tmp_path, 16)
    tokenizer = _tokenizer(tasks)
    docs = build_write_documents(tasks, tokenizer, expert_fraction=0.5, seed=0)
    a = batch_for_step(docs, 7, 12, seed=3, pad_id=0, prefix_len=10)
    b = batch_for_step(docs, 7, 12, seed=3, pad_id=0, prefix_len=10)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert sum(len(ids) for ids, _ in a) == 12 and len(a) > 1
    assert all(ids.numel() <= MICRO_BATCH_TOKENS or len(ids) == 1 for ids, _ in a)
    c = batch_for_step(docs, 8, 12, seed=3, pad_id=0, prefix_len=10)
    assert not all(x.shape == y.shape and torch.equal(x, y) for (x, _), (y, _) in zip(a, c))
    # Data parallel: process r of 3 takes its share; the shares hold each document once, about as many tokens each.
    rows = step_documents(docs, 7, 12, seed=3)
    shares = [batch_for_step(docs, 7, 12, seed=3, pad_id=0, prefix_len=10, rank=r, world=3) for r in range(3)]
    assert sum(len(ids) for share in shares for ids, _ in share) == 12
    tokens = [sum(int((ids != 0).sum()) for ids, _ in share) for share in shares]
    assert max(tokens) - min(tokens) <= max(len(docs[i].token_ids) - 10 for i in rows)
    whole = sorted(tuple(row[mask_row].tolist()) for ids, mask in a for row, mask_row in zip(ids, mask))
    split = sorted(tuple(row[mask_row].tolist()) for share in shares for ids, mask in share
                   for row, mask_row in zip(ids, mask))
    assert whole == split and len(rows) == 12


def test_shares_give_each_process_about_as_many_tokens():
    assert share([10, 20, 30, 40], 1) == [0, 0, 0, 0]
    assert share([10, 20, 30, 40], 2) == [0, 1, 1, 0]  # 40 + 10 | 30 + 20
    assert share([100, 100, 100], 2) == [0, 1, 0]
    owner = share(list(range(100, 116)), 4)
    loads = [sum(n for n, r in zip(range(100, 116), owner) if r == k) for k in range(4)]
    assert sorted(owner) == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4 and max(loads) - min(loads) <= 4


def test_micro_batches_are_the_cheapest_cut_within_the_token_budget():
    """Every way of cutting sorted rows into consecutive runs, priced as padded tokens plus the per-run overhead:
    the dynamic programme finds the cheapest that keeps each run of several rows within MICRO_BATCH_TOKENS."""
    import itertools

    def cost(lengths, runs):
        return sum((b - a) * lengths[b - 1] + MICRO_BATCH_OVERHEAD_TOKENS for a, b in runs)

    def fits(lengths, runs):
        return all(b - a == 1 or (b - a) * lengths[b - 1] <= MICRO_BATCH_TOKENS for a, b in runs)

    rng = random.Random(0)
    for n in (1, 2, 5, 9):
        for _ in range(20):
            lengths = sorted(rng.choice([rng.randint(150, 300), rng.randint(400, 1000), 5000]) for _ in range(n))
            runs = micro_batches(lengths)
            assert [a for a, _ in runs] == [0] + [b for _, b in runs[:-1]] and runs[-1][1] == n
            assert fits(lengths, runs)
            every = []
            for cuts in itertools.product([False, True], repeat=n - 1):
                edges = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
                every.append(list(zip(edges, edges[1:])))
            assert cost(lengths, runs) == min(cost(lengths, r) for r in every if fits(lengths, r))
    # Rows of one length stay together; a long row leaves short ones to their own run.
    assert micro_batches([200] * 8) == [(0, 8)]
    assert micro_batches([200] * 8 + [900]) == [(0, 8), (8, 9)]
    # Without a token budget (the RL trainer's calls within a micro-batch), and only for sorted rows.
    assert cheapest_cut([100] * 50 + [101], overhead=150) == [(0, 51)]
    assert cheapest_cut([100] * 50 + [400], overhead=150) == [(0, 50), (50, 51)]
    with pytest.raises(ValueError, match="ascending"):
        cheapest_cut([300, 200], overhead=150)


def test_config_hash_ignores_where_a_run_goes_but_not_what_it_trains():
    base = PretrainConfig()
    assert config_hash(base) == config_hash(base.model_copy(update={"run_dir": "elsewhere", "threads": 1,
                                                                     "processes": 2, "log_every": 3,
                                                                     "checkpoint_every": 7}))
    assert config_hash(base) != config_hash(base.model_copy(update={"lr": base.lr / 2}))
    assert config_hash(base) != config_hash(base.model_copy(update={"episode_fraction": base.episode_fraction / 2}))
    assert config_hash(base) != config_hash(base.model_copy(update={"reserve_structures": True}))


def test_processes_default_to_one_per_cpu_sharing_the_cpus(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)  # macOS has none
    assert processes_for(PretrainConfig()) == (2, 1)
    assert processes_for(PretrainConfig(processes=1)) == (1, 2)
    assert processes_for(PretrainConfig(processes=1, threads=1)) == (1, 1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert processes_for(PretrainConfig()) == (4, 4)
    assert processes_for(PretrainConfig(batch_size=2)) == (2, 8)


def test_the_config_defaults_are_the_default_recipe():
    recipe = load_config(PretrainConfig, Path(__file__).resolve().parents[2] / "configs" / "pretrain" / "default.toml")
    assert config_hash(recipe) == config_hash(PretrainConfig())  # ensure_base_model(PretrainConfig()) reuses it


def test_heldout_eval_tasks_are_heldout_structures_of_each_difficulty(tmp_path):
    tasks = heldout_tasks(tmp_path, 7, max_difficulty=2, seed=0)
    assert [t.metadata["difficulty"] for t in tasks] == [1, 1, 1, 1, 2, 2, 2]
    assert all(structure_split(t.metadata["structure"]) == "heldout" for t in tasks)
    assert len({t.task_id for t in tasks}) == 7
    again = load_task(generate_task(0, "heldout", 0, difficulty=1).write(tmp_path / "again"))
    assert again.instructions == tasks[0].instructions


def test_wilson_interval():
    lo, hi = wilson_interval(50, 100)
    assert abs(lo - 0.4038) < 1e-3 and abs(hi - 0.5962) < 1e-3
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


class _Oracle(torch.nn.Module):
    """Predicts each document's next token, except at the positions `wrong` maps to another token."""

    def __init__(self, docs, vocab_size, wrong):
        super().__init__()
        self.next = {tuple(d.token_ids.tolist()): d.token_ids[1:].tolist() + [0] for d in docs}
        self.vocab_size, self.wrong = vocab_size, wrong

    def forward(self, ids):
        key = tuple(ids[0].tolist())
        logits = torch.zeros(1, len(key), self.vocab_size)
        for t, token in enumerate(self.next[key]):
            logits[0, t, self.wrong.get((key, t), token)] = 1.0
        return ModelOutput(logits)


def test_teacher_forced_misses_place_each_wrong_argmax_in_a_comment_the_code_or_the_call(tmp_path):
    tasks = _tasks(tmp_path, 6)
    tokenizer = _tokenizer(tasks)
    docs = build_write_documents(tasks, tokenizer, expert_fraction=1.0, seed=0)
    perfect = teacher_forced_misses(_Oracle(docs, tokenizer.vocab_size, {}), tokenizer, tasks)
    assert perfect["perfect"] == 6 and not any(perfect["with_miss"].values())

    def position(doc, where):  # the first policy token of the write whose decoded text passes `where`
        positions = np.flatnonzero(doc.loss_mask)
        return next(int(p) for p in positions
                    if where(tokenizer.decode(doc.token_ids[positions[0]:p].tolist()),
                             tokenizer.decode([int(doc.token_ids[p])])))

    wrong = {}
    has_digit = [any(ch.isdigit() for c in stage_comments(_solution(t, True, random.Random(0))) for ch in c)
                 for t in tasks]
    first, second = docs[has_digit.index(True)], docs[has_digit.index(True) + 1]
    # in `first`, a constant in a stage comment, the code's first line and the call's first token are wrong
    digit = position(first, lambda text, tok: "#" in text and any(ch.isdigit() for ch in tok))
    code = position(first, lambda text, tok: "result" in tok or "return" in tok)
    key = tuple(first.token_ids.tolist())
    wrong[(key, digit - 1)] = wrong[(key, code - 1)] = wrong[(key, int(np.flatnonzero(first.loss_mask)[0]) - 1)] = 7
    # in `second`, a word of a stage comment only
    word = position(second, lambda text, tok: text.rsplit("\\n", 1)[-1].lstrip().startswith("#")
                    and tok.strip().isalpha())
    wrong[(tuple(second.token_ids.tolist()), word - 1)] = 7
    report = teacher_forced_misses(_Oracle(docs, tokenizer.vocab_size, wrong), tokenizer, tasks)
    assert report["perfect"] == 4 and report["only_digit_misses"] == 0
    assert report["with_miss"] == {"comment_digit": 1, "comment_word": 1, "code_digit": 0, "code_word": 1, "call": 1}
    missed = report["per_task"][has_digit.index(True)]["misses"]
    assert [m["kind"] for m in missed] == ["call", "comment_digit", "code_word"]
    assert report["per_task"][has_digit.index(True) + 1]["misses"][0]["predicted"] == tokenizer.decode([7])
