from prefill_service.server import main

main()
