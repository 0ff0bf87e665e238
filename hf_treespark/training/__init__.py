"""Drafter training: data (prompts, regeneration, references), losses, replay and the trainer."""
