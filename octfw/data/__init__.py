"""Data reading and preparation: DICOM I/O, synthetic cohorts, masks, transforms."""
