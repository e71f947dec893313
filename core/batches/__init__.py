"""The Batch API's durable state, in the frontend process: uploaded files and their records in an SQLite
database beside a files folder (``[batch] dir``), kept across restarts."""
