"""What ``torch.compile`` did in each step of a loop (ovqflex/compile_watch.py): graph breaks with their
reasons, recompiles at a shape already run, functions dynamo gave up on, and the totals. Toy modules
compiled with the ``eager`` backend: dynamo traces (and counts) exactly as for inductor, in milliseconds."""
import re
import threading

import pytest
import torch
import torch._dynamo.config as dynamo_config

from ovqflex.compile_watch import CompileCounts, CompileWatch, break_reason, compile_counts


class Plain(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu().sum()


class Broken(Plain):
    def forward(self, x):
        y = self.lin(x)
        torch._dynamo.graph_break()
        return y.relu().sum()


class Counting(Plain):
    """Reads a Python int that changes every call: dynamo guards on its value, so every call recompiles."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return (self.lin(x) * self.calls).sum()


class TwiceBroken(Counting):
    """Two graph breaks of one kind per call, and every call recompiles all three graphs (each reads the
    changing int)."""

    def forward(self, x):
        self.calls += 1
        y = self.lin(x) * self.calls
        torch._dynamo.graph_break()
        y = y.relu() * self.calls
        torch._dynamo.graph_break()
        return y.sum() * self.calls


class Skipped(Plain):
    """A frame dynamo skips (its ``skip_frame``): it runs eager; dynamo records it, but as no recompile limit."""

    def forward(self, x):
        torch._dynamo.skip_frame()
        return self.lin(x).sum()


def run(module, lengths):
    """``module`` compiled (eager backend, static shapes), one forward+backward per length; the watch's
    notes per step and the watch."""
    torch._dynamo.reset()
    fwd = torch.compile(module, backend="eager", dynamic=False)
    notes = []
    with CompileWatch() as watch:
        for step, T in enumerate(lengths, 1):
            x = torch.randn(T, 4)
            fwd(x).backward()
            notes.append(watch.step(step, tuple(x.shape)))
    return notes, watch


def test_a_model_that_compiles_once_per_shape_has_nothing_to_say():
    notes, watch = run(Plain(), [3, 3, 5, 5, 3])
    assert notes == [[]] * 5
    assert watch.counts() == {"graphs": 2, "graph_breaks": 0, "recompiles": 0, "gave_up": 0}
    assert watch.first_graphs == 1
    assert watch.summary() == "torch.compile: 2 graphs, no graph break, no recompile"


def test_a_graph_break_is_reported_once_at_the_step_that_traced_it_with_its_reason():
    notes, watch = run(Broken(), [3, 3, 3])
    assert len(notes[0]) == 1 and notes[1:] == [[], []]
    assert notes[0][0].startswith("step 1: torch.compile split the model at 1 graph break(s)")
    assert "graph_break" in notes[0][0] and "(x" not in notes[0][0] and "TORCH_LOGS=graph_breaks" in notes[0][0]
    assert watch.graph_breaks == 1 and watch.recompiles == 0
    assert watch.first_graphs == 2  # the graphs before and after the break
    assert "1 graph break," in watch.summary()


def test_graphs_compiled_at_a_shape_already_run_are_recompiles_naming_the_step_that_ran_it():
    notes, watch = run(Counting(), [3, 5, 3])
    assert notes[0] == [] and notes[1] == []  # a new shape compiles: expected
    assert notes[2] == ["step 3: torch.compile compiled 1 new graph(s) for inputs of shape 3x4, which step 1 ran "
                        "already: a recompile (TORCH_LOGS=recompiles says why)"]
    assert watch.counts() == {"graphs": 3, "graph_breaks": 0, "recompiles": 1, "gave_up": 0}
    assert watch.summary() == "torch.compile: 3 graphs, no graph break, 1 recompile"


def test_breaks_of_one_kind_are_counted_and_every_graph_of_a_recompile_is_one():
    notes, watch = run(TwiceBroken(), [3, 5, 3])
    assert len(notes[0]) == 1 and re.fullmatch(  # one reason (reasons are joined by "; "), counted twice
        r"step 1: torch\.compile split the model at 2 graph break\(s\), and runs the code between the graphs unfused: "
        r"Call to `torch\._dynamo\.graph_break\(\)`[^;]* \(x2\) \(TORCH_LOGS=graph_breaks shows where\)", notes[0][0])
    assert notes[2][1] == ("step 3: torch.compile compiled 3 new graph(s) for inputs of shape 3x4, which step 1 ran "
                           "already: a recompile (TORCH_LOGS=recompiles says why)")
    assert watch.counts() == {"graphs": 9, "graph_breaks": 6, "recompiles": 3, "gave_up": 0}


def test_a_skipped_frame_is_not_a_function_given_up_at_the_recompile_limit():
    notes, watch = run(Skipped(), [3, 5])
    assert notes == [[], []] and watch.gave_up == 0


def test_a_function_dynamo_gives_up_on_at_its_recompile_limit_is_reported():
    # (the config's own patch: pytest >= 9.2's monkeypatch deletes, on undo, an attribute that a module
    # serves from __getattr__, as torch's config modules do, which hides the setting from everyone after)
    with dynamo_config.patch(recompile_limit=2):
        notes, watch = run(Plain(), [3, 5, 7, 9])
    assert notes[:2] == [[], []] and notes[3] == []
    assert len(notes[2]) == 1 and notes[2][0].startswith(
        "step 3: dynamo stopped compiling 1 function(s) at its recompile limit "
        "(torch._dynamo.config.recompile_limit = 2): they run eager")
    assert watch.counts() == {"graphs": 2, "graph_breaks": 0, "recompiles": 0, "gave_up": 1}
    assert watch.summary().endswith("1 function left eager at the recompile limit")


def test_two_watches_open_at_once_stop_counting_and_say_so():
    started, go_on = threading.Event(), threading.Event()
    other = {}

    def second():
        with CompileWatch() as w:
            started.set()
            go_on.wait(30)
            other["watch"] = w

    with CompileWatch() as first:
        t = threading.Thread(target=second)
        t.start()
        started.wait(30)
        assert first.step(1, (3,)) == []
        go_on.set()
        t.join()
    for w in (first, other["watch"]):
        assert w.mixed and w.counts()["graphs"] is None
        assert "not counted" in w.summary()
    with CompileWatch() as alone:  # once alone again, a new watch counts
        assert not alone.mixed


def test_step_outside_the_context_is_refused():
    with pytest.raises(RuntimeError, match="outside `with CompileWatch"):
        CompileWatch().step(1, (3,))


def test_counts_subtract_reason_by_reason():
    before = CompileCounts(3, (("a: x", 1),), 0)
    after = CompileCounts(5, (("a: x", 2), ("b: y", 1)), 1)
    assert after - before == CompileCounts(2, (("a: x", 1), ("b: y", 1)), 1)
    assert (after - before).graph_breaks == 2
    assert compile_counts() - compile_counts() == CompileCounts(0, (), 0)
    # a reason met no more often than before is not in the interval (nor one whose count fell: counters cleared)
    assert CompileCounts(4, (("a: x", 1),), 0) - CompileCounts(3, (("a: x", 1), ("b: y", 2)), 0) == \
        CompileCounts(1, (), 0)


def test_a_break_reason_is_its_kind_and_explanation_on_one_line():
    message = "Failed to trace builtin operator\n  Explanation: Dynamo does not know print.\n  Hint: avoid it.\n"
    assert break_reason(message) == "Failed to trace builtin operator: Dynamo does not know print."
    assert break_reason("Unsupported thing") == "Unsupported thing"
    assert break_reason("") == "(no message)"
