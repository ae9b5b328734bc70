"""Pruning schedules, one class each (runner/schedules/schedule.py says what a schedule is):
none, constant and polynomial (magnitude.py), m_by_n, structured. Importing the package
defines them all."""

from runner.schedules import m_by_n, magnitude, structured
from runner.schedules.schedule import SCHEDULES, Schedule, schedule_of

__all__ = ["SCHEDULES", "Schedule", "m_by_n", "magnitude", "schedule_of", "structured"]
