"""Rounds: one block's open round, its close, and what a closed round becomes (`RoundSink`)."""
