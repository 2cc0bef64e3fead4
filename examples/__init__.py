"""Worked examples of plugging a user gym and TRL-style reward functions into the trainer (docs/gyms.md)."""
