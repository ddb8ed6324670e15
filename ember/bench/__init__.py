"""`ember bench`: a load generator for any OpenAI-compatible server, with reports and plots.

Talks to servers over HTTP only; never imports the engine.
"""
