#!/usr/bin/env python3
"""A plain Azure Blob client (azure-storage-blob) for the object tier tests
against Azurite: it checks what converged wrote with code that is not
converged's. The account is Azurite's well-known development account.

usage: azblob.py ENDPOINT mkbucket CONTAINER
       azblob.py ENDPOINT put CONTAINER NAME FILE
       azblob.py ENDPOINT get CONTAINER NAME FILE    (exit 3 when the blob is missing)
       azblob.py ENDPOINT list CONTAINER PREFIX       (one name per line)
"""
import sys

from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError
from azure.storage.blob import BlobServiceClient

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def main():
    endpoint, cmd, *args = sys.argv[1:]
    conn = (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")
    svc = BlobServiceClient.from_connection_string(conn)
    if cmd == "mkbucket":
        svc.create_container(args[0])
        return
    container = svc.get_container_client(args[0])
    if cmd == "put":
        with open(args[2], "rb") as f:
            container.upload_blob(args[1], f.read(), overwrite=True)
    elif cmd == "get":
        # A large blob downloads in ranges pinned to its ETag: one replaced or
        # deleted in between fails the download, which is then tried again.
        for attempt in range(5):
            try:
                body = container.download_blob(args[1]).readall()
                break
            except ResourceNotFoundError:
                sys.exit(3)
            except ResourceModifiedError:
                if attempt == 4:
                    raise
        with open(args[2], "wb") as f:
            f.write(body)
    elif cmd == "list":
        for b in container.list_blobs(name_starts_with=args[1]):
            print(b.name)
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
