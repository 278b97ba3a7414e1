"""The failure policy around the store: what a call gets when the store fails or stalls."""
