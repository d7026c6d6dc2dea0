"""The preemption agreement's parts that need no Ray (ray_internals/preemption_agreement.py):
rank 0's answers held in the controller (check_answers.py) and a node's folder of answers
(worker/node_answers.py). The whole, against the real controller class on a real Ray, with
the calls per check counted: tests/test_ray_internals.py."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from orchestrator.private_dir import NotPrivateError, private_dir
from orchestrator.ray_internals.check_answers import KEEP, Answers
from orchestrator.worker import node_answers
from orchestrator.worker.node_answers import NotPosted, Poster, PosterGone, Reader


def test_a_check_is_answered_with_rank_0s_answer_whenever_each_side_arrives():
    """A poster asking before rank 0 publishes waits for it, one asking after gets it at once;
    rank 0 learns the longest wait the posters said they had at their last check, over its last
    two answers (what its checks cost the others: it paces them by it)."""

    async def scenario():
        answers = Answers(timeout_s=30)
        early = asyncio.ensure_future(answers.answer(1))
        await asyncio.sleep(0.05)
        assert not early.done()  # waits for rank 0, not for the other nodes
        assert answers.publish(1, ("notice", (4, False, 0))) == 0.0
        late = await answers.answer(1)
        assert await early == late == ("notice", (4, False, 0))
        second = [asyncio.ensure_future(answers.answer(2, waited_s=w)) for w in (0.25, 0.5)]
        await asyncio.sleep(0.05)
        waited = [answers.publish(2, (None, (4, False, 0)))]
        assert [await s for s in second] == [(None, (4, False, 0))] * 2
        waited += [answers.publish(check, None) for check in (3, 4)]
        return waited

    assert asyncio.run(scenario()) == [0.5, 0.5, 0.0]


def test_a_group_shut_down_fails_its_waiting_checks_and_old_checks_are_refused():
    class GroupShutDown(Exception):
        pass

    async def scenario():
        answers = Answers(timeout_s=0.2)
        with pytest.raises(TimeoutError, match="rank 0 did not reach preemption check 1"):
            await answers.answer(1)
        for check in range(1, KEEP + 3):
            answers.publish(check, check)
        with pytest.raises(LookupError, match=f"more than {KEEP} checks behind"):
            await answers.answer(2)
        assert await answers.answer(KEEP + 2) == KEEP + 2
        waiting = asyncio.ensure_future(answers.answer(KEEP + 3))
        await asyncio.sleep(0.05)
        answers.close(GroupShutDown("the worker group's barrier was shut down"))
        with pytest.raises(GroupShutDown):
            await waiting
        with pytest.raises(GroupShutDown):
            await answers.answer(KEEP + 4)

    asyncio.run(scenario())


def test_a_nodes_ranks_read_what_its_poster_posts_in_a_folder_of_the_users_alone(tmp_path):
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    poster = Poster("group-1", "10.0.0.7", base)
    assert poster.folder.name == "answers-group-1-10.0.0.7"
    assert oct(poster.folder.stat().st_mode & 0o777) == "0o700"
    readers = [Reader("group-1", "10.0.0.7", base) for _ in range(3)]
    assert all(reader.shares_disk() for reader in readers)
    assert not Reader("group-1", "10.0.0.8", base).shares_disk()  # another node's address
    got = []
    threads = [threading.Thread(target=lambda r=r: got.append(r.read(1, 30))) for r in readers]
    for thread in threads:
        thread.start()  # waiting: nothing posted yet
    poster.post(1, ("notice", (2, True, 0)))
    for thread in threads:
        thread.join(30)
    assert got == [("notice", (2, True, 0))] * 3
    for check in range(2, node_answers.KEEP + 3):
        poster.post(check, check)
    assert sorted(int(name) for name in os.listdir(poster.folder) if name.isdigit()) == list(
        range(3, node_answers.KEEP + 3))  # the last KEEP
    with pytest.raises(NotPosted, match=f"check {node_answers.KEEP + 9}'s answer was not posted"):
        readers[0].read(node_answers.KEEP + 9, 0.05)
    poster.close()
    assert not poster.folder.exists()
    with pytest.raises(PosterGone):  # its rank ended first: asked elsewhere, not waited for
        readers[0].read(KEEP + 3, 30)


def test_a_folder_open_to_others_or_a_link_is_never_read_and_a_killed_groups_is_removed(
        tmp_path):
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    open_folder = node_answers.folder_of("open", "n", base)
    open_folder.mkdir(mode=0o755)
    open_folder.chmod(0o755)
    with pytest.raises(NotPrivateError, match="open to group or others") as refused:
        Reader("open", "n", base).read(1, 1)
    assert refused.value.retry is False  # a restart meets the same folder: the run stops
    with pytest.raises(NotPrivateError, match="cannot make") as unmade:  # a full disk may pass
        private_dir(tmp_path / "no-parent" / "f")
    assert getattr(unmade.value, "retry", True) is True
    elsewhere = tmp_path / "planted"
    elsewhere.mkdir(mode=0o700)
    node_answers.folder_of("linked", "n", base).symlink_to(elsewhere)
    with pytest.raises(NotPrivateError, match="symbolic link"):
        Reader("linked", "n", base).read(1, 1)
    with pytest.raises(NotPrivateError):  # a poster never posts through it either
        Poster("linked", "n", base)
    killed = Poster("killed", "n", base)
    os.close(killed._fd)  # its process died: the kernel dropped its lock
    killed._fd = None
    following = Poster("next", "n", base)
    assert not killed.folder.exists() and following.folder.exists()
    killed_later = Poster("killed-later", "n", base)
    os.close(killed_later._fd)
    killed_later._fd = None
    following.close()  # a poster that ends removes it too
    assert not killed_later.folder.exists() and not following.folder.exists()
