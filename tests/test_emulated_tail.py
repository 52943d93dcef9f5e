"""`run_emulated(freeze_after_last_step=True)`: the clock stops at the last training step (the
simulator's finish), while the final eval, checkpoint and exit run on this machine's seconds; the
node is billed for them as for a shutdown (at replay speed, at most the notice)."""

import pytest

from cloud import emulated as replay
from tests.shared_data import needs_spot_data
from trainwise import emulated as emu


@needs_spot_data
@pytest.mark.slow  # one trainer process (about 10 s on a shared 2-core machine)
def test_the_clock_is_frozen_after_the_last_step_and_the_tail_billed_as_a_shutdown(tmp_path):
    result = emu.run_emulated("pystdlib", max_steps=10, policy_name="on_demand",
                              window_start_tick=300, out_dir=tmp_path, run_id="tail",
                              max_wall_s=240, freeze_after_last_step=True)
    assert result.status == "completed" and result.steps == 10
    (node,) = result.holdings
    # Completion is the clock at the last step (frozen there); the bill runs on past it for the
    # final eval, checkpoint and exit, the notice at most (an exit of more than 120/975 wall s
    # always reaches it). Without the freeze the bill ends at completion, the exit on the clock.
    notice_s = replay.default_rules().notice_s
    assert node["end_s"] == pytest.approx(result.finish_s + notice_s)
    assert node["end_reason"] == "completed"
    assert result.final_eval_loss is not None
