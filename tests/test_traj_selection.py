"""Path roles, budgeted selection by priority (main path always kept), and the `unknown` role classifier."""

from __future__ import annotations

import pytest

from gyre_ray.trajectory.config import TrajectorySection
from gyre_ray.trajectory.paths import select_paths, tree_paths
from gyre_ray.trajectory.records import CallRecord
from gyre_ray.trajectory.roles import ROLE_PRIORITY, classify_roles
from gyre_ray.trajectory.synthetic import SyntheticWorkload, synthetic_execution
from gyre_ray.trajectory.tree import CallTree

SYS = list(range(100, 110))
SUB = list(range(200, 210))
COMPACT = list(range(300, 306))  # a compaction prompt of its own (not an extension of the main context)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


class Builder:
    def __init__(self, unknown: bool = False) -> None:
        self.records: list[CallRecord] = []
        self.truth: dict[str, str] = {}
        self.unknown = unknown

    def add(self, cid: str, role: str, prompt: list[int], output: list[int]) -> list[int]:
        t = float(len(self.records))
        self.truth[cid] = role
        rec_role = "unknown" if self.unknown else role
        self.records.append(
            CallRecord(
                "e", cid, rec_role, prompt, output, [-1.0] * len(output), [0] * len(output), t, t + 0.5
            )
        )
        return prompt + output


def hand_built(unknown: bool = False) -> tuple[list[CallRecord], dict[str, str]]:
    """Main with a retry and two compactions (one in-context, one with its own prompt), four
    sub-agents (one compacting in-context, one with its own summary prompt)."""
    b = Builder(unknown)
    ctx = b.add("m1", "main", SYS + toks(1000, 5), toks(1100, 30))
    b.add("m2-try", "main", ctx + toks(1200, 5), toks(1300, 40))  # abandoned attempt
    ctx = b.add("m2", "main", ctx + toks(1200, 5), toks(1400, 35))
    b.add("sa1", "sub-agent", SUB + toks(2000, 4), toks(2100, 50))
    sa2 = b.add("sa2", "sub-agent", SUB + toks(2200, 4), toks(2300, 20))
    summary2 = b.add("sa2-sum", "sub-agent-summary", sa2 + toks(2400, 3), toks(2500, 12))[-12:]
    b.add("sa2b", "sub-agent", SUB + summary2, toks(2600, 10))
    summary1 = b.add("m-sum", "main-summary", ctx + toks(1500, 3), toks(1600, 12))[-12:]
    ctx = b.add("m3", "main", SYS + toks(1000, 5) + summary1, toks(1700, 4))  # the short final main path
    sa3 = b.add("sa3", "sub-agent", SUB + toks(2700, 4), toks(2800, 25))
    sa3_sum = b.add("sa3-sum", "sub-agent-summary", COMPACT + sa3[len(SUB) :], toks(2900, 12))[-12:]
    b.add("sa3b", "sub-agent", SUB + sa3_sum, toks(3000, 8))
    m_sum2 = b.add("m-sum2", "main-summary", COMPACT + ctx[len(SYS) :], toks(3100, 12))[-12:]
    b.add("m4", "main", SYS + toks(1000, 5) + m_sum2, toks(3200, 3))
    return b.records, b.truth


def processed(records, budget=5, tie_break="longest"):
    tree = CallTree.build(records)
    roles = classify_roles(tree)
    paths = tree_paths(tree, roles)
    return tree, roles, paths, select_paths(paths, tree, roles, budget, tie_break)


def leaf_call(tree, path) -> str:
    return tree.calls[path.calls[-1]].call_id


def test_path_roles_take_the_highest_priority_call_on_the_path() -> None:
    records, _ = hand_built()
    tree, _, paths, _ = processed(records)
    roles = {leaf_call(tree, p): p.role for p in paths}
    assert roles == {
        "m2-try": "main",
        "m-sum": "main",  # the in-context compaction extends the main context: a main path
        "m3": "main",
        "m-sum2": "main-summary",  # a compaction with its own prompt: a main-summary path
        "m4": "main",
        "sa1": "sub-agent",
        "sa2-sum": "sub-agent",
        "sa2b": "sub-agent",
        "sa3": "sub-agent",
        "sa3-sum": "sub-agent-summary",
        "sa3b": "sub-agent",
    }


@pytest.mark.parametrize("budget", range(1, 13))
def test_budget_and_priority_with_the_main_path_first(budget: int) -> None:
    records, _ = hand_built()
    tree, _, paths, selected = processed(records, budget)
    assert len(selected) == min(budget, len(paths))
    assert leaf_call(tree, selected[0]) == "m4", "the path of the last main call is always kept, first"
    ranks = [ROLE_PRIORITY[p.role] for p in selected[1:]]
    assert ranks == sorted(ranks)
    dropped = [p for p in paths if p not in selected]
    if dropped and len(selected) > 1:
        assert min(ROLE_PRIORITY[p.role] for p in dropped) >= ranks[-1]


def test_selection_order_on_the_hand_built_tree() -> None:
    records, _ = hand_built()
    tree, _, _, selected = processed(records, budget=7)
    assert [leaf_call(tree, p) for p in selected] == [
        "m4",
        "m-sum",
        "m2-try",
        "m3",
        "m-sum2",
        "sa1",
        "sa2-sum",
    ]


def test_main_path_is_kept_even_when_it_is_the_shortest() -> None:
    records, _ = hand_built()
    tree, _, paths, selected = processed(records, budget=1)
    main = selected[0]
    assert leaf_call(tree, main) == "m4"
    assert main.num_loss_tokens == min(p.num_loss_tokens for p in paths)


@pytest.mark.parametrize(
    ("tie_break", "expected"),
    [("longest", ["sa1", "sa2-sum"]), ("latest", ["sa3b", "sa3"]), ("earliest", ["sa1", "sa2-sum"])],
)
def test_tie_break_orders_paths_of_equal_role(tie_break: str, expected: list[str]) -> None:
    records, _ = hand_built()
    tree, _, _, selected = processed(records, budget=7, tie_break=tie_break)
    assert [leaf_call(tree, p) for p in selected[5:]] == expected


def test_bad_budget_and_tie_break_are_rejected() -> None:
    records, _ = hand_built()
    tree = CallTree.build(records)
    roles = classify_roles(tree)
    with pytest.raises(ValueError, match="budget must be >= 1"):
        select_paths(tree_paths(tree, roles), tree, roles, budget=0)
    with pytest.raises(ValueError, match="tie_break must be one of longest, latest, earliest"):
        select_paths(tree_paths(tree, roles), tree, roles, tie_break="random")


def test_classifier_recovers_every_role_of_the_hand_built_tree_from_shape() -> None:
    records, truth = hand_built(unknown=True)
    tree = CallTree.build(records)
    assert dict(zip((c.call_id for c in tree.calls), classify_roles(tree), strict=True)) == truth


@pytest.mark.parametrize("seed", range(12))
def test_classifier_recovers_roles_of_synthetic_harness_executions(seed: int) -> None:
    records, truth = synthetic_execution("e", seed, SyntheticWorkload(system_tokens=24, unknown_roles=True))
    tree = CallTree.build(records)
    by_id = dict(zip((r.call_id for r in records), truth, strict=True))
    assert classify_roles(tree) == [by_id[c.call_id] for c in tree.calls]


WORDS = {i: f"w{i} " for i in range(1000)}
WORDS.update({1: "You are a sub-agent. ", 2: "Summarize the conversation so far. ", 3: "You are a coder. "})


def decode(ids) -> str:
    return "".join(WORDS[i] for i in ids)


def test_markers_classify_calls_the_shape_cannot() -> None:
    b = Builder(unknown=True)
    ctx = b.add("m1", "main", [3, 10, 11], [12, 13])
    b.add("sum", "main-summary", ctx + [2], [14])  # too short to be seen seeding anything
    b.add("helper", "sub-agent", [1, 20], [21])
    b.add("restart", "main", [3, 10, 11, 30], [31])  # opens with the main agent's first prompt
    b.add("other", "sub-agent", [40, 41], [42])  # no marker, no seed: a sub-agent by default
    tree = CallTree.build(b.records)
    truth = ["main", "main-summary", "sub-agent", "main", "sub-agent"]
    assert classify_roles(tree, decode=decode) == truth
    # Markers read only the ends of a prompt: a marker in the middle (tool output) is ignored.
    window = TrajectorySection(marker_window_chars=8)
    assert classify_roles(tree, window, decode=decode)[1] == "main"
    # Without text the compaction looks like an ordinary main leaf.
    assert classify_roles(tree) == ["main", "main", "sub-agent", "main", "sub-agent"]


def test_a_re_encoded_summary_still_seeds_the_new_context() -> None:
    b = Builder(unknown=True)
    ctx = b.add("m1", "main", [3, 10, 11], [12, 13])
    summary = b.add("sum", "main-summary", ctx + [2], toks(500, 10) + [99])[-11:]  # ends with a stop token
    merged = [777] + summary[1:-1]  # first token merged with the preceding text, stop token dropped
    b.add("m2", "main", [60, 61] + merged + [62], [63])  # new system prompt, seeded by the summary
    tree = CallTree.build(b.records)
    assert classify_roles(tree) == ["main", "main-summary", "main"]


def test_known_roles_vote_for_unknown_calls_of_their_thread() -> None:
    b = Builder()
    ctx = b.add("a", "sub-agent", [5, 6], [7, 8])
    b.add("b", "unknown", ctx + [9], [10])
    b.add("c", "main", [40, 41], [42])
    tree = CallTree.build(b.records)
    assert classify_roles(tree) == ["sub-agent", "sub-agent", "main"]


def test_a_compaction_with_its_own_prompt_belongs_to_the_agent_whose_history_it_holds() -> None:
    b = Builder(unknown=True)
    ctx = b.add("m1", "main", SYS + toks(1000, 5), toks(1100, 20))
    ctx = b.add("m2", "main", ctx + toks(1200, 5), toks(1300, 20))
    b.add("sa", "sub-agent", SUB + toks(2000, 4), toks(2100, 20))
    summary = b.add("m-sum", "main-summary", COMPACT + ctx[len(SYS) :], toks(1500, 12))[-12:]
    b.add("m3", "main", toks(4000, 6) + summary, toks(1600, 5))
    tree = CallTree.build(b.records)
    assert classify_roles(tree) == [b.truth[c.call_id] for c in tree.calls]


def cut_off_main() -> list[CallRecord]:
    """The main agent restarts from an edited context and its last call is cut off at the timeout
    before it generates a token: that call's path has nothing to train."""
    b = Builder()
    ctx = b.add("m1", "main", SYS + toks(1000, 5), toks(1100, 3))
    b.add("m2", "main", ctx + toks(1200, 2), toks(1300, 2))
    b.add("m3", "main", SYS + toks(1000, 5) + [99], [])
    return b.records


@pytest.mark.parametrize("budget", [1, 5])
def test_a_path_without_loss_tokens_takes_no_place(budget: int) -> None:
    tree, _, paths, selected = processed(cut_off_main(), budget=budget)
    assert sorted(p.num_loss_tokens for p in paths) == [0, 5]
    assert [leaf_call(tree, p) for p in selected] == ["m2"]  # the last main call that generated tokens
    assert selected[0].num_loss_tokens == 5


def test_an_execution_without_generated_tokens_still_has_its_main_path() -> None:
    b = Builder()
    b.add("m1", "main", SYS + toks(1000, 5), [])
    tree, _, _, selected = processed(b.records)
    assert [leaf_call(tree, p) for p in selected] == ["m1"]


def test_a_sub_agent_answer_returned_as_a_tool_result_is_not_a_summary() -> None:
    """Roles hidden: main spawns a sub-agent whose answer comes back to main as a tool result, then
    main compacts with a prompt of its own that holds that answer in the history. The answer seeds
    nothing: the sub-agent stays a sub-agent and the compaction is main's."""
    b = Builder(unknown=True)
    ctx = b.add("m1", "main", SYS + toks(1000, 5), toks(1100, 10))
    answer = b.add("sa1", "sub-agent", SUB + toks(2000, 4), toks(2100, 12))[-12:]
    ctx = b.add("m2", "main", ctx + toks(1200, 2) + answer + toks(1250, 2), toks(1300, 10))
    summary = b.add("m-sum", "main-summary", COMPACT + ctx[len(SYS) :], toks(1600, 12))[-12:]
    b.add("m3", "main", SYS + toks(1000, 5) + summary, toks(1700, 4))
    tree = CallTree.build(b.records)
    assert dict(zip((c.call_id for c in tree.calls), classify_roles(tree), strict=True)) == b.truth


def test_a_compaction_the_proxy_left_unknown_is_placed_by_the_tree() -> None:
    """The proxy records a summary request with a system prompt of its own as `unknown` (it cannot
    tell main's compaction from a sub-agent's); among known roles the tree finds it is main's."""
    b = Builder()
    ctx = b.add("m1", "main", SYS + toks(1000, 5), toks(1100, 10))
    b.add("sa1", "sub-agent", SUB + toks(2000, 4), toks(2100, 12))
    ctx = b.add("m2", "main", ctx + toks(1200, 2), toks(1300, 10))
    summary = b.add("m-sum", "main-summary", COMPACT + ctx[len(SYS) :], toks(1600, 12))[-12:]
    b.add("m3", "main", SYS + toks(1000, 5) + summary, toks(1700, 4))
    b.records[3].role = "unknown"
    tree = CallTree.build(b.records)
    assert dict(zip((c.call_id for c in tree.calls), classify_roles(tree), strict=True)) == b.truth


def test_a_path_that_adds_no_new_loss_token_takes_no_place() -> None:
    """Main calls aborted before they generated anything, each after another tool result, are leaves
    off the main context: their paths count the main context's tokens but add none. They used to take
    3 of the 5 places ahead of a sub-agent, which was dropped with 30 of the 95 generated tokens."""
    from gyre_ray.trajectory.packing import pack_paths
    from gyre_ray.trajectory.pipeline import process_execution

    b = Builder()
    ctx = b.add("m1", "main", SYS + [10], toks(1000, 10)) + [11]
    ctx = b.add("m2", "main", ctx, toks(1010, 10)) + [12]
    summary = b.add("sum", "main-summary", ctx + [13], toks(1020, 5))[-5:]
    ctx = b.add("m3", "main", SYS + [14] + summary, toks(1100, 20)) + [15]
    for k in range(4):
        b.add(f"aborted-{k}", "main", ctx + [30 + k], [])
    b.add("m4", "main", ctx + [16], toks(1200, 20))
    b.add("sa", "sub-agent", SUB, toks(2000, 30))
    processed = process_execution(b.records)
    roles = sorted(p.role for p in processed.selected)
    assert roles == ["main", "main", "sub-agent"], (
        roles
    )  # the final main path, the first context, the sub-agent
    every = sum(sum(node.loss) for node in processed.tree.nodes())
    assert every == 95 and sum(pack_paths("e", processed.selected).loss_mask) == every


def test_a_compaction_is_mains_though_a_sub_agents_answer_came_back_last() -> None:
    """A compaction with a summariser prompt of its own (recorded `unknown`) re-renders the main
    history, whose last tool result is a sub-agent's answer: the latest output in its prompt is then
    the sub-agent's. Its owner is the latest call whose own turn it re-renders (main), not that one:
    it was labelled `sub-agent-summary`, the lowest priority."""
    main_sys, sub_sys, summariser = toks(5000, 10), toks(6000, 10), toks(7000, 10)
    b = Builder()
    ctx = main_sys + [1, 2, 3]
    first = b.add("m1", "main", ctx, toks(100, 12))[-12:]
    ctx = ctx + first + [4]
    spawn = b.add("m2", "main", ctx, toks(112, 12))[-12:]
    step = b.add("s1", "sub-agent", sub_sys + spawn[6:], toks(200, 12))[-12:]
    answer = b.add("s2", "sub-agent", sub_sys + spawn[6:] + step + [5], toks(212, 12))[-12:]
    ctx = ctx + spawn + [6] + answer + [7]  # the answer comes back as a tool result
    b.unknown = True
    summary = b.add("sum", "main-summary", summariser + [8] + ctx[len(main_sys) :] + [9], toks(300, 12))[-12:]
    b.unknown = False
    b.add("m3", "main", main_sys + [10] + summary, toks(400, 12))
    roles = classify_roles(CallTree.build(b.records))
    assert roles == ["main", "main", "sub-agent", "sub-agent", "main-summary", "main"]
