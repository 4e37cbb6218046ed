"""Reading a chain for people and other tools: summaries, the flight recorder, other formats."""
