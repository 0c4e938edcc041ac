"""Failpoints of the rank process, declared here so the parent's catalogue has them too
(rank_main itself must not be imported by the package: it runs as ``__main__``)."""

from phalanx.lifecycle.failpoints import Failpoint

TASK_RECEIVED = Failpoint("rank.task.received", "a rank took a user task frame off its channel")
START_BEFORE_HELLO = Failpoint("rank.start.before_hello", "a rank started, before HELLO")
