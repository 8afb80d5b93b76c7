from decode_service.server import main

main()
