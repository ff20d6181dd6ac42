"""The agent loop of ``determinism=full`` (:mod:`stapo.train.agent_loop`), built from verl's registry as verl's
agent-loop worker builds it and run through verl's own ``SingleTurnAgentLoop.run``. Only the vLLM server is stood in
(it needs a GPU): it records the sampling parameters each request reaches it with."""

import asyncio
import json
import uuid

import pytest
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, _agent_loop_registry
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.rollout.replica import TokenOutput

import stapo.train.plugin  # noqa: F401  (what verl loads in every process: registers the agent loop)
from stapo.config import CONFIG_DIR, SEEDED_AGENT_LOOP, TAPE_GLOB
from stapo.quickstart.tiny import build_tokenizer
from stapo.train.agent_loop import TapeError, load_tape, request_seed

PROMPTS = [[{"role": "user", "content": "What is 6 times 7?"}], [{"role": "user", "content": "What is 2 plus 2?"}]]
N = 8  # responses per prompt, as the recipe's rollout.n


def load(*overrides):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="stapo", overrides=list(overrides))


class Server:
    """Stands in for verl's LLM server client (vLLM on a GPU): answers every request with three tokens (which, with a
    seed, depend on it)."""

    def __init__(self):
        self.requests = []

    async def generate(self, request_id, prompt_ids, sampling_params, **kwargs):
        self.requests.append((request_id, dict(sampling_params)))
        seed = sampling_params.get("seed", 0)
        return TokenOutput(
            token_ids=[5 + seed % 7, 6, 7],
            log_probs=[-0.1 - seed % 11 / 7, -0.2, -0.3],
            extra_fields={"global_steps": 5},
        )


class NoServer:
    """A server client that must not be asked: a replayed run generates nothing."""

    async def generate(self, *args, **kwargs):
        raise AssertionError("a replayed rollout asked the server")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = build_tokenizer([m[0]["content"] for m in PROMPTS] * 20, tmp_path_factory.mktemp("tok"))
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tok


def rollout(config, tokenizer, v1: bool = True, step: int = 5, server=None, outputs=None, **given) -> list:
    """One step's requests: N responses of each prompt through the loop that
    ``actor_rollout_ref.rollout.agent.default_agent_loop`` names, called as verl's V1 agent-loop worker calls it (the
    recipe's trainers: ``session_id`` i of n, the step, a random ``uid``, no ``priority``) or, with ``v1=False``, as
    V0's (``priority``: the response's place in the batch). The loop's outputs are appended to ``outputs``."""
    name = config.actor_rollout_ref.rollout.agent.default_agent_loop
    server = Server() if server is None else server
    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True, **given}

    async def step_requests():
        for place in range(len(PROMPTS) * N):
            loop = instantiate(
                config=_agent_loop_registry[name],
                trainer_config=DictConfigWrap(config=config),
                server_manager=server,
                tokenizer=tokenizer,
                processor=None,
                hf_model_type=None,
                dataset_cls=RLHFDataset,
                data_config=DictConfigWrap(config.data),
            )
            prompt = {"raw_prompt": PROMPTS[place // N]}
            if v1:
                prompt |= {"session_id": place % N, "global_steps": step, "uid": uuid.uuid4().hex}
            else:
                prompt["priority"] = place
            output = await loop.run(dict(sampling), **prompt)
            if outputs is not None:
                outputs.append(output)

    asyncio.run(step_requests())
    return getattr(server, "requests", [])


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v0"])
def test_each_response_of_a_group_gets_a_seed_of_its_own_and_a_rerun_the_same(tokenizer, v1):
    config = load("determinism=full")
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == SEEDED_AGENT_LOOP
    requests = rollout(config, tokenizer, v1)
    seeds = [params["seed"] for _, params in requests]
    assert len(seeds) == len(PROMPTS) * N and len(set(seeds)) == len(seeds)  # verl alone: one seed for all of them
    assert all(0 <= seed < 2**31 for seed in seeds)
    names = [request_id for request_id, _ in requests]  # verl's own names, det-<place>: V1 gave none (all det-0)
    assert names == ([f"det-{seed}" for seed in seeds] if v1 else [f"det-{p}" for p in range(len(seeds))])
    assert [params["seed"] for _, params in rollout(config, tokenizer, v1)] == seeds  # the same step again
    other = load("determinism=full", "actor_rollout_ref.rollout.seed=7")
    assert {params["seed"] for _, params in rollout(other, tokenizer, v1)}.isdisjoint(seeds)  # another run seed
    if v1:
        assert {params["seed"] for _, params in rollout(config, tokenizer, v1, step=6)}.isdisjoint(seeds)
    given = rollout(config, tokenizer, v1, seed=5)
    assert {params["seed"] for _, params in given} == {5}  # a given seed is sent
    assert len({request_id for request_id, _ in given}) == len(given)  # and the requests keep names of their own


def test_without_determinism_the_loop_is_verls(tokenizer):
    """The recipe's default keeps verl's loop, whose requests carry no seed (vLLM samples freely); the seeded loop
    adds none either when ``full_determinism`` is off."""
    config = load()
    assert config.actor_rollout_ref.rollout.agent.default_agent_loop == "single_turn_agent"
    assert all("seed" not in params for _, params in rollout(config, tokenizer))
    config.actor_rollout_ref.rollout.agent.default_agent_loop = SEEDED_AGENT_LOOP
    assert all("seed" not in params for _, params in rollout(config, tokenizer))


def test_request_seed_depends_on_the_run_seed_the_prompt_and_the_place():
    seed = request_seed(42, PROMPTS[0], 5, 3, 0)
    assert seed == request_seed(42, [dict(PROMPTS[0][0])], 5, 3, 0)  # a copy of the messages: the same seed
    others = request_seed(43, PROMPTS[0], 5, 3, 0), request_seed(42, PROMPTS[1], 5, 3, 0)
    others += request_seed(42, PROMPTS[0], 6, 3, 0), request_seed(42, PROMPTS[0], 5, 4, 0)
    others += (request_seed(42, PROMPTS[0], 5, 3, 1),)  # the prompt's text again, from another row of the data
    assert len({seed, *others}) == 6


def responses(outputs) -> list:
    return [(o.prompt_ids, o.response_ids, o.response_logprobs, o.extra_fields.get("global_steps")) for o in outputs]


def test_a_replayed_rollout_is_the_recorded_one_without_generating(tokenizer, tmp_path):
    """stapo.record_rollouts writes what the server answered; stapo.replay_rollouts gives it back to the loop, response
    by response (tokens, log-probabilities, extra fields), without asking the server."""
    tape = tmp_path / "tape"
    recorded, replayed = [], []
    rollout(load("determinism=full", f"stapo.record_rollouts={tape}"), tokenizer, outputs=recorded)
    rollout(load("determinism=full"), tokenizer, outputs=(plain := []))
    assert responses(recorded) == responses(plain)  # recording changes nothing
    assert len(list(tape.glob(TAPE_GLOB))) == 1 and len(load_tape(str(tape))) == len(PROMPTS) * N
    rollout(load("determinism=full", f"stapo.replay_rollouts={tape}"), tokenizer, server=NoServer(), outputs=replayed)
    assert responses(replayed) == responses(recorded)
    assert len({tuple(r[1]) for r in responses(replayed)}) > 1  # the responses differ: the seeds keyed them apart
    with pytest.raises(TapeError, match="no response for the request of seed"):  # another step was not recorded
        rollout(load("determinism=full", f"stapo.replay_rollouts={tape}"), tokenizer, step=6, server=NoServer())
    with pytest.raises(TapeError, match="a response to another prompt or sampling setting"):  # another temperature
        rollout(
            load("determinism=full", f"stapo.replay_rollouts={tape}"), tokenizer, server=NoServer(), temperature=0.7
        )


def test_a_tape_cut_by_a_kill_or_mixing_two_runs(tmp_path):
    """The last line of a recording cut short by a kill is left out; a seed recorded twice with other tokens (a resumed
    record run, or two runs into one folder) stops the replay with one message, while the same tokens twice do not."""
    line = {"seed": 1, "prompt": "ab", "output": {"token_ids": [1]}}
    (tmp_path / "rollouts-a-1.jsonl").write_text(json.dumps(line) + "\n" + '{"seed": 2, "pro')
    assert list(load_tape(str(tmp_path))) == [1]
    (tmp_path / "rollouts-b-2.jsonl").write_text(
        json.dumps(line | {"output": {"token_ids": [1], "num_preempted": 3}}) + "\n"
    )
    load_tape.cache_clear()
    assert list(load_tape(str(tmp_path))) == [1]  # the same tokens again (another preemption count): no conflict
    (tmp_path / "rollouts-c-3.jsonl").write_text(json.dumps(line | {"output": {"token_ids": [2]}}) + "\n")
    load_tape.cache_clear()
    with pytest.raises(TapeError, match="recorded twice with different responses"):
        load_tape(str(tmp_path))
