"""Serving: one step per endpoint, from OpenAI fields to a planned request and back to what the
client receives.
"""
