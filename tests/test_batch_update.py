"""BatchUpdateBuilder and BatchUpdate (seed 001 ch. 7.2-7.3, ch. 8, appendix U2)."""

import dataclasses

import pytest

from tinyvllm.sample.batch_update import BatchUpdate, BatchUpdateBuilder, MoveDirectionality
from tinyvllm.sampling_params import SamplingParams


@pytest.mark.seed("001:8", "001:U2")
def test_removed_is_descending_and_pop_takes_lowest_u2():
    # Appendix U2.2: holes registered as 7, 3, 5 are handed out 3, 5, 7.
    builder = BatchUpdateBuilder()
    for index in (7, 3, 5):
        builder.removed_append(index)
    assert builder.peek_removed() == 3
    assert builder.removed == [7, 5, 3]
    assert [builder.pop_removed() for _ in range(3)] == [3, 5, 7]
    assert builder.pop_removed() is None
    assert builder.peek_removed() is None


@pytest.mark.seed("001:8")
def test_removed_append_after_read_raises():
    builder = BatchUpdateBuilder()
    builder.removed_append(2)
    _ = builder.removed
    with pytest.raises(RuntimeError, match="removed row 4"):
        builder.removed_append(4)


@pytest.mark.seed("001:8")
@pytest.mark.parametrize("reader", ["peek_removed", "pop_removed"])
def test_removed_append_after_peek_or_pop_raises(reader):
    builder = BatchUpdateBuilder()
    builder.removed_append(1)
    getattr(builder, reader)()
    with pytest.raises(RuntimeError):
        builder.removed_append(0)


@pytest.mark.seed("001:8")
def test_append_allowed_again_after_get_and_reset():
    builder = BatchUpdateBuilder()
    builder.removed_append(1)
    builder.pop_removed()
    assert builder.get_and_reset(0) is None  # the only hole was filled; nothing recorded
    builder.removed_append(3)  # a new step: allowed again
    update = builder.get_and_reset(3)
    assert update is not None and list(update.removed) == [3]


@pytest.mark.seed("001:8")
def test_get_and_reset_none_when_nothing_changed():
    assert BatchUpdateBuilder().get_and_reset(5) is None


@pytest.mark.seed("001:8", "001:U2", "001:7.5")
def test_get_and_reset_snapshot_is_frozen_and_independent():
    builder = BatchUpdateBuilder()
    params = SamplingParams()
    out: list[int] = []
    builder.removed_append(0)
    builder.removed_append(4)
    builder.added.append((1, params, [1, 2], out))
    builder.moved.append((3, 0, MoveDirectionality.UNIDIRECTIONAL))
    update = builder.get_and_reset(4)
    assert update == BatchUpdate(4, [4, 0], [(1, params, [1, 2], out)], [(3, 0, MoveDirectionality.UNIDIRECTIONAL)])
    # the builder starts new lists: later edits leave the snapshot alone
    builder.added.append((2, params, None, []))
    builder.removed_append(9)
    assert len(update.added) == 1 and list(update.removed) == [4, 0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.batch_size = 7


@pytest.mark.seed("001:8")
def test_reset_reports_batch_changed():
    builder = BatchUpdateBuilder()
    assert builder.reset() is False
    builder.removed_append(2)
    assert builder.batch_changed
    assert builder.reset() is True
    assert not builder.has_removed() and builder.batch_changed is False
    builder.batch_changed = True  # a pooling model's change, recorded in no list
    assert builder.reset() is True


@pytest.mark.seed("001:7", "001:7.5")
def test_added_output_list_is_a_live_reference():
    builder = BatchUpdateBuilder()
    out = [5]
    builder.added.append((0, SamplingParams(), None, out))
    update = builder.get_and_reset(1)
    out.append(6)
    assert update.added[0][3] == [5, 6]
    assert update.added[0][3] is out


@pytest.mark.seed("001:7")
def test_move_directionality_members():
    assert {m.name for m in MoveDirectionality} == {"UNIDIRECTIONAL", "SWAP"}
