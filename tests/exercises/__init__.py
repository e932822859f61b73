"""Checks of the classroom exercises in lessons/exercises/ (see lessons/exercises/README.md)."""
