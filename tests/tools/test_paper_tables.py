"""The paper comparison's reading of its own tables (``tools.paper_tables.reading``): each
sentence is counted off the plans, so a regenerated file never keeps a claim its numbers
no longer show."""
import types

from longshield_fx.tools import paper_tables as PT
from longshield_fx.tools.plan import MODELS, OUTSIDE_ALLOCATOR_GIB, GiB


class Layout:
    """A solved layout as the tables read it: its max T and its total at any T."""

    def __init__(self, max_T, reserved_gib: float = 10.0):
        self.max_T, self.reserved_gib = max_T, reserved_gib

    def breakdown(self, T):
        return types.SimpleNamespace(total=(self.reserved_gib + OUTSIDE_ALLOCATOR_GIB) * GiB)


def papers_own(model: str) -> PT.ModelPlans:
    """Plans that reach exactly the paper's max T everywhere, 10 GiB at every T."""
    v3_T = max(T for T, (_, v3) in PT.PAPER_TABLE5[model].items() if v3 is not None)
    return PT.ModelPlans(
        model, v3=Layout(v3_T), v2={mbs: Layout(T) for mbs, (T, _) in PT.PAPER_TABLE4[model].items()},
        fsdp={(g, mbs): Layout(PT.PAPER_TABLE2[model][g][i]) for g in PT.GPUS_FSDP
              for i, mbs in enumerate(PT.MBS_FSDP)})


def test_every_sentence_follows_the_numbers():
    plans = [papers_own(m) for m in MODELS]
    text = "\n".join(PT.reading(plans))
    assert "ours shorter" not in text and "ours longer" not in text
    assert "power of two in 12 of 12 cases, longer in 0, shorter in 0" in text
    assert "below it everywhere" in text

    small = plans[0]
    small.fsdp[(4, 1)] = Layout(2 * small.fsdp[(4, 1)].max_T)  # one Table 2 cell longer
    small.fsdp[(1, 8)] = Layout(None)  # one the paper fits and we do not
    small.v3 = Layout(8 * small.v3.max_T, reserved_gib=100.0)  # V3 longer, and above the paper's memory
    text = "\n".join(PT.reading(plans))
    assert "ours longer in 1 of 36 cells" in text
    assert f"ours shorter where the paper fits ({small.model} on 1 GPU at MBS 8)" in text
    assert "power of two in 11 of 12 cases, longer in 1, shorter in 0" in text
    assert "below it everywhere" not in text and "GiB for V3." in text
