"""Trajectory processing: call records -> prefix tree -> selected paths -> packed training samples."""
