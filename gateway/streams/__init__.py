"""Streams that survive: journaled resumable streams, ``Idempotency-Key`` records, take-over of a
dead gateway's streams, and migration of a choice whose worker broke off."""
