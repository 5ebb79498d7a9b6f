"""The gateway's SQL state: engine, models, repositories and the schema version.

Only the gateway and the ``conveyor`` CLI open the database (DESIGN.md section 7);
workers learn what they need through Redis.
"""
