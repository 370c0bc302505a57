"""Capacity planning: how the engine behaves under a load it has not seen yet (a queueing model run as a
discrete-event simulation of the real scheduler), and what that means for replicas and autoscaling (``rtx plan``)."""
