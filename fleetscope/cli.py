def main() -> None:
    print("fleetscope")
